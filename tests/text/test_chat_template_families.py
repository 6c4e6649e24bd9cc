"""The real Gemma 3 and Qwen3 chat templates (tests/fixtures/chat_templates.py) rendered by pyklei as
transformers' apply_chat_template renders them: text and token ids, over conversations that
reach their system handling, alternation checks, reverse iteration and namespace() (Qwen3's
last-query search), .split on </think>, tools through tojson, tool results, and enable_thinking
on, off and absent; and a model file without a chat template that chats with one passed in."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import ROOT

from chat_templates import GEMMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, QWEN3_THINKING_CHAT_TEMPLATE
from pyklei.text.chat_template import ChatTemplateError, render

pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather — météo «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi  \n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
     {"role": "user", "content": "Again, in 日本語 🙂"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22C"}],
    [{"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "q"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],    # Gemma refuses
]
KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": TOOLS}]
TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE,
             "qwen3-thinking": QWEN3_THINKING_CHAT_TEMPLATE}


@pytest.fixture(scope="module")
def hf_qwen():
    from transformers import AutoTokenizer

    from tokenizer_references import qwen_hf_dir
    return AutoTokenizer.from_pretrained(str(qwen_hf_dir()))


def _hf(hf, template, conv, agp, kw, tokenize=False):
    try:
        out = hf.apply_chat_template(conv, chat_template=template, tokenize=tokenize,
                                     add_generation_prompt=agp, **kw)
    except Exception as e:      # jinja2's TemplateError from raise_exception
        return ("error", type(e).__name__)
    return list(out["input_ids"]) if tokenize and not isinstance(out, list) else out


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_transformers_renders_them(hf_qwen, name):
    template, compared = TEMPLATES[name], 0
    for conv in CONVERSATIONS:
        for kw in KWARGS:
            for agp in (True, False):
                want = _hf(hf_qwen, template, conv, agp, kw)
                try:
                    got = render(template, conv, add_generation_prompt=agp,
                                 bos_token=hf_qwen.bos_token or "", eos_token=hf_qwen.eos_token, **kw)
                except ChatTemplateError:
                    got = ("error", "TemplateError")
                assert got == want, (conv, kw, agp)
                compared += isinstance(want, str)
    assert compared >= 40


def test_qwen3_thinking_switch_and_history(hf_qwen):
    off = render(QWEN3_CHAT_TEMPLATE, CONVERSATIONS[0], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(QWEN3_CHAT_TEMPLATE, CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")
    hist = render(QWEN3_CHAT_TEMPLATE, CONVERSATIONS[2])
    assert "hmm" not in hist and "<|im_start|>assistant\nHello!<|im_end|>" in hist


def test_qwen3_prompt_ids_are_transformers(hf_qwen):
    from pyklei.converters.hf_tokenizer import tokenizer_kv
    from pyklei.text.tokenizer import Tokenizer
    from tokenizer_references import qwen_hf_dir

    d = qwen_hf_dir()
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_metadata({k: v for k, v, *_ in tokenizer_kv(d, cfg, cfg["vocab_size"])})
    for conv in CONVERSATIONS:
        for kw in KWARGS:
            want = _hf(hf_qwen, QWEN3_CHAT_TEMPLATE, conv, True, kw, tokenize=True)
            assert tok.apply_chat_template(conv, tokenize=True, **kw) == want, (conv, kw)


def test_gemma3_prompt_ids_are_transformers():
    from transformers import AutoTokenizer

    from pyklei.text.tokenizer import Tokenizer
    from tokenizer_references import gemma3_gguf_or_skip

    path = gemma3_gguf_or_skip()
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template is None            # the base model's file has none
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    for conv in CONVERSATIONS[:4]:
        want = _hf(hf, GEMMA3_CHAT_TEMPLATE, conv, True, {}, tokenize=True)
        got = tok.apply_chat_template(conv, tokenize=True)
        assert got == want and got[0] == 2 and got[-3:] == tok.encode("<start_of_turn>model\n",
                                                                      add_bos=False), conv


# ---- a file without a chat template ---------------------------------------------------------

CHATML = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory):
    """A tiny random Llama converted from a checkpoint with no chat template."""
    from models import make_tiny_llama
    from pyklei.converters import convert

    d = tmp_path_factory.mktemp("untemplated")
    hf = make_tiny_llama(d / "hf", n_layer=1, seed=3)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    convert(hf, d / "m.gguf")
    return d / "m.gguf"


def test_a_file_without_a_template_chats_with_one_passed_in(untemplated):
    import pyklei
    from pyklei.text.chat_template import MissingChatTemplateError

    with pyklei.load(untemplated, n_threads=1, n_ctx=256) as llm:
        assert llm.tokenizer.chat_template is None
        with pytest.raises(MissingChatTemplateError):
            llm.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    with pyklei.load(untemplated, n_threads=1, n_ctx=256, chat_template=CHATML) as llm:
        r = llm.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)
        assert r.generation_tokens >= 1 and r.prompt_tokens == len(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=True))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        pyklei.load(untemplated, n_threads=1, n_ctx=256, chat_template="{% for %}")


def test_cli_chat_takes_a_template_file(untemplated, tmp_path):
    root = ROOT

    def chat(*extra):
        return subprocess.run([sys.executable, "-m", "pyklei", "chat", str(untemplated), "-t", "1",
                               "-c", "256", "-n", "3", "--temperature", "0", *extra],
                              input="hi\n/exit\n", capture_output=True, text=True, timeout=120,
                              cwd=root)
    r = chat()
    assert r.returncode != 0 and "--chat-template" in r.stderr
    (tmp_path / "t.jinja").write_text(CHATML)
    r = chat("--chat-template", str(tmp_path / "t.jinja"))
    assert r.returncode == 0, r.stderr
    r = chat("--chat-template", str(tmp_path / "missing.jinja"))
    assert r.returncode != 0 and "no such chat template file" in r.stderr


def test_cli_chat_template_kwargs_reach_the_template(untemplated, tmp_path):
    root = ROOT
    (tmp_path / "t.jinja").write_text(CHATML + "{% if flag is defined and flag %}FLAGGED{% endif %}")

    def gen(*extra):
        return subprocess.run([sys.executable, "-m", "pyklei", "generate", str(untemplated), "-t", "1",
                               "-c", "256", "-n", "1", "--chat", "-p", "hi", "--stats",
                               "--chat-template", str(tmp_path / "t.jinja"), *extra],
                              capture_output=True, text=True, timeout=120, cwd=root)
    plain, flagged = gen(), gen("--chat-template-kwargs", '{"flag": true}')
    assert plain.returncode == 0 and flagged.returncode == 0, plain.stderr + flagged.stderr

    def prompt_tokens(r):
        import re
        return int(re.search(r"prompt: +(\d+) tokens", r.stderr).group(1))
    assert prompt_tokens(flagged) > prompt_tokens(plain)
    for bad, why in (("{nope", "not JSON"), ('{"messages": 1}', "set by pyklei")):
        r = gen("--chat-template-kwargs", bad)
        assert r.returncode == 2 or r.returncode == 1
        assert why in r.stderr, r.stderr
