"""pyklei.chat_template against transformers' apply_chat_template on the same templates."""
from __future__ import annotations

import functools
import warnings
from datetime import datetime
from pathlib import Path

import pytest

from pyklei.chat_template import (CHATML_TEMPLATE, ChatTemplateError, MissingChatTemplateError, compile_template,
                                  render)
from pyklei.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).resolve().parents[2] / "shared" / "vocab"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c  \n\n d"}],
    [{"role": "user", "content": "Ünïcödé 😀 <|im_end|> {{ not a template }} {% raw %}"}],
    [{"role": "assistant", "content": ""}],
]

# Templates written for these tests, each exercising Hugging Face features: bos_token, loop
# controls, namespace, tojson with its keywords, trim_blocks/lstrip_blocks whitespace handling,
# tools, raise_exception, a {% generation %} block, strftime_now.
TEST_TEMPLATES = {
    "header-style": (
        "{{ bos_token }}\n"
        "{% set ns = namespace(sys=none) %}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}\n"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>\n"
        "{% endfor %}\n"
        "{% if ns.sys is not none %}[system was: {{ ns.sys }}]{% endif %}\n"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "json-tools": (
        "{% if tools %}Tools:\n{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{% endif %}"
        "{{ messages | tojson }}|{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}"
        "|{{ {'x': '<&>é'} | tojson(ensure_ascii=true) }}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}{{ eos_token }}"
    ),
    "strict-roles": (
        "{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
        "Year {{ strftime_now('%Y') }}"
    ),
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time in a city, e.g. \"Zürich\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@functools.lru_cache(maxsize=None)
def _smollm2() -> Tokenizer:
    try:
        from pyklei_dev.assets import smollm2_gguf
        path = smollm2_gguf()
    except Exception as e:
        pytest.skip(f"SmolLM2 GGUF unavailable ({e})")
    return Tokenizer.from_gguf(path)


@functools.lru_cache(maxsize=None)
def _hf(template: str, bos: str, eos: str):
    """A transformers PreTrainedTokenizerFast carrying ``template`` (its vocabulary is irrelevant)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, bos: 1, eos: 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                unk_token="<unk>", chat_template=template)


def _hf_render(template, messages, bos, eos, **kw) -> str:
    return _hf(template, bos, eos).apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_smollm2_real_template_matches_transformers(conv, add_generation_prompt):
    tok = _smollm2()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    messages = CONVERSATIONS[conv]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = _hf_render(tok.chat_template, messages, tok.id_to_token(tok.bos_id), tok.id_to_token(tok.eos_id),
                     add_generation_prompt=add_generation_prompt)
    assert ours == ref


def test_smollm2_template_text_and_tokens():
    tok = _smollm2()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[0] == 1 and ids.count(2) == 2 and tok.decode(ids) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(TEST_TEMPLATES))
def test_feature_templates_match_transformers(name, add_generation_prompt):
    template = TEST_TEMPLATES[name]
    for messages in CONVERSATIONS:
        kw = {"tools": TOOLS} if name == "json-tools" else {}
        ours = render(template, messages, add_generation_prompt=add_generation_prompt,
                      bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", **kw)
        ref = _hf_render(template, messages, "<|begin_of_text|>", "<|eot_id|>",
                         add_generation_prompt=add_generation_prompt, **kw)
        assert ours == ref, name


def test_strftime_and_trim():
    out = render(TEST_TEMPLATES["strict-roles"], CONVERSATIONS[0])
    assert out.endswith(f"Year {datetime.now():%Y}")
    out = render("{% if true %}\n  x\n{% endif %}\n", [])
    assert out == "  x\n"  # trim_blocks drops the newline after a tag, lstrip_blocks the indent before it


def test_raise_exception_and_errors():
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render(TEST_TEMPLATES["strict-roles"], [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for m in messages %}", [])
    with pytest.raises(TypeError):
        render(CHATML_TEMPLATE, {"role": "user", "content": "x"})


def test_sandbox():
    with pytest.raises(ChatTemplateError):  # immutable: no list mutation
        render("{% set x = [] %}{{ x.append(1) }}", [])
    with pytest.raises(ChatTemplateError):  # no access to internals
        render("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError):
        render("{% set ns = namespace(_x=1) %}", [])
    assert compile_template(CHATML_TEMPLATE) is compile_template(CHATML_TEMPLATE)


def test_missing_template_error_and_fallback():
    with pytest.raises(MissingChatTemplateError, match="no chat template"):
        render(None, CONVERSATIONS[0])
    with pytest.warns(UserWarning, match="ChatML"):
        out = render("", CONVERSATIONS[1], fallback="chatml")
    assert out == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        render(None, CONVERSATIONS[0], fallback="llama9")


def test_llama_vocab_files_have_no_template():
    # The Llama 3 / Llama 2 vocabulary GGUFs carry no tokenizer.chat_template: a clear error.
    for name in ("ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf"):
        path = VOCAB_DIR / name
        if not path.exists():
            pytest.skip(f"{path} not found (shared/ beside the repository)")
        tok = Tokenizer.from_gguf(path)
        assert tok.chat_template is None
        with pytest.raises(MissingChatTemplateError):
            tok.apply_chat_template(CONVERSATIONS[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert tok.apply_chat_template(CONVERSATIONS[0], fallback="chatml").startswith("<|im_start|>user")
