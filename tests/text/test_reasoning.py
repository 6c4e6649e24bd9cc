"""Qwen3's thinking kept apart from the answer (pyklei.text.reasoning): the split of a whole reply
and of a stream (the same for any chunking), where a reply starts (the template may open
<think>), which models think, and the split as the API and the server hand it out
(message.reasoning_content / .reasoning, streamed deltas, never in content), with
chat_template_kwargs reaching the template. The server runs in-process over Qwen3's real
vocabulary and template with a scripted engine (no Qwen3 weights here)."""
from __future__ import annotations

import json
import random

import pytest

from chat_templates import QWEN3_CHAT_TEMPLATE, QWEN3_THINKING_CHAT_TEMPLATE
from pyklei.text.reasoning import Reasoning, reasoning_for

THOUGHT = "<think>\nThe user greets me.\nI should greet back.\n</think>\n\nHello! How can I help?"


@pytest.mark.parametrize("text, inside, want", [
    (THOUGHT, False, ("The user greets me.\nI should greet back.", "Hello! How can I help?")),
    ("Hello there.", False, (None, "Hello there.")),                     # enable_thinking=False
    ("  <think>x</think>y", False, ("x", "y")),
    ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),                    # an empty thought
    ("I know <think> as a word", False, (None, "I know <think> as a word")),
    ("<think>\ncut by max_tokens\n\n", False, ("cut by max_tokens", "")),
    ("reasoning first\n</think>\n\nanswer", True, ("reasoning first", "answer")),   # opened by the template
    ("still thinking <", True, ("still thinking <", "")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),                  # only the first closes
    ("<thin", False, (None, "<thin")),
    ("", False, (None, "")),
    ("", True, ("", "")),
])
def test_split(text, inside, want):
    assert Reasoning(starts_inside=inside).split(text) == want


@pytest.mark.parametrize("inside", [False, True])
def test_a_stream_splits_as_the_whole_reply_for_any_chunking(inside):
    rng = random.Random(0)
    texts = [THOUGHT, "Hello.", "<think>\n\n</think>\n\nHi\n", "a\n\n</think>\n \nb", "<think>",
             "x</thi", "\n\n<think>a\n\n\nb\n</think>c<think>d", "</think>", "<", "<think>\n"]
    fmt = Reasoning(starts_inside=inside)
    for text in texts:
        want = fmt.split(text)
        for _ in range(60):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 6))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            p = fmt.parser()
            r = c = ""
            for piece in pieces:
                dr, dc = p.feed(piece)
                r, c = r + dr, c + dc
            dr, dc = p.finish()
            r, c = r + dr, c + dc
            assert ((r if p.reasoned else None), c) == want, (text, pieces)


def test_a_stream_holds_back_only_what_may_be_a_tag():
    p = Reasoning().parser()
    assert p.feed("<think>\nstep one") == ("step one", "")
    assert p.feed(" and two</th") == (" and two", "")          # "</th" may become </think>
    assert p.feed("ink>\n\nThe answer") == ("", "The answer")
    assert p.feed(" is 4.") == ("", " is 4.")


# ---- which models think, where a reply starts -------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tok():
    from pyklei.converters.hf_tokenizer import tokenizer_kv
    from pyklei.text.tokenizer import Tokenizer
    from tokenizer_references import qwen_hf_dir

    d = qwen_hf_dir()
    cfg = json.loads((d / "config.json").read_text())
    return Tokenizer.from_metadata({k: v for k, v, *_ in tokenizer_kv(d, cfg, cfg["vocab_size"])})


ASK = [{"role": "user", "content": "Hi"}]


def test_where_a_qwen3_reply_starts(qwen_tok):
    tok = qwen_tok
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    on = tok.apply_chat_template(ASK, tokenize=True)
    off = tok.apply_chat_template(ASK, tokenize=True, enable_thinking=False)
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning_for(tok, on) == Reasoning(starts_inside=False)
    assert reasoning_for(tok, off) == Reasoning(starts_inside=False)
    tok.chat_template = QWEN3_THINKING_CHAT_TEMPLATE
    try:
        opened = tok.apply_chat_template(ASK, tokenize=True)
    finally:
        tok.chat_template = QWEN3_CHAT_TEMPLATE
    assert tok.decode(opened).endswith("<|im_start|>assistant\n<think>\n")
    assert reasoning_for(tok, opened) == Reasoning(starts_inside=True)


def test_models_without_think_tokens_do_not_reason(qwen_tok):
    class NoThink:
        def token_to_id(self, t):
            return None
    assert reasoning_for(NoThink(), [1, 2, 3]) is None


# ---- the Python API --------------------------------------------------------------------------

def _scripted_llm(tok, pieces, seen):
    """An LLM whose generation is `pieces` (the tokenizer and chat() are pyklei's own)."""
    from pyklei.llm import LLM
    from pyklei.runtime.generate import GenerationResponse

    def responses():
        for k, text in enumerate(pieces):
            last = k == len(pieces) - 1
            yield GenerationResponse(text=text, token=1, finish_reason="stop" if last else None,
                                     prompt_tokens=len(seen[-1]), prompt_eval_tokens=len(seen[-1]),
                                     generation_tokens=k + 1, time_to_first_token=0.0,
                                     prompt_tps=0.0, generation_tps=0.0, peak_rss_mb=0.0)

    def generate(prompt, max_tokens, stream, *args):
        from pyklei.llm import _collect
        seen.append(list(prompt))
        return responses() if stream else _collect(responses())

    llm = LLM.__new__(LLM)
    llm.tokenizer = tok
    llm._generate = generate
    return llm


def test_api_chat_keeps_reasoning_apart(qwen_tok):
    pieces = ["<think>", "\nThe user", " greets me.", "\nI should greet back.\n</th", "ink>\n\n",
              "Hello! How", " can I help?"]
    seen = []
    llm = _scripted_llm(qwen_tok, pieces, seen)
    r = llm.chat(ASK)
    assert r.text == "Hello! How can I help?"
    assert r.reasoning == "The user greets me.\nI should greet back."
    streamed = list(llm.chat(ASK, stream=True))
    assert "".join(x.text for x in streamed) == r.text
    assert "".join(x.reasoning or "" for x in streamed) == r.reasoning
    assert not any("<think>" in x.text or "</think>" in x.text for x in streamed)
    llm.chat(ASK, chat_template_kwargs={"enable_thinking": False})
    assert qwen_tok.decode(seen[-1]).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="messages"):
        llm.chat(ASK, chat_template_kwargs={"messages": []})
    with pytest.raises(TypeError, match="chat_template_kwargs"):
        llm.chat(ASK, chat_template_kwargs=["enable_thinking"])


def test_terminal_chat_shows_reasoning_apart_and_keeps_it_out_of_the_history(qwen_tok):
    """`pyklei chat` (ChatSession): the reasoning goes to its own writer, the answer to the
    other, and the history holds the answer only; a model without <think> writes everything."""
    from types import SimpleNamespace

    from pyklei.chat import ChatSession

    pieces = ["<think>", "\nThe user", " greets me.\n</th", "ink>\n\n", "Hello!", " Hi."]
    seen = []
    llm = _scripted_llm(qwen_tok, pieces, seen)
    llm.model = SimpleNamespace(n_ctx=512)
    session = ChatSession(llm, max_tokens=64)
    answer, thought = [], []
    text, interrupted, dropped = session.reply("Hi", answer.append, thought.append)
    assert (text, interrupted, dropped) == ("Hello! Hi.", False, 0)
    assert "".join(answer) == "Hello! Hi." and "".join(thought) == "The user greets me."
    assert session.last_reasoning == "The user greets me."
    assert session.history[-1] == {"role": "assistant", "content": "Hello! Hi."}
    answer.clear()
    session.reply("Again", answer.append)          # no reasoning writer: the reasoning is dropped
    assert "".join(answer) == "Hello! Hi."


def test_api_chat_tool_calls_are_read_from_the_content_only(qwen_tok):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    llm = _scripted_llm(qwen_tok, ["<think>\nI could write " + call + " here\n</think>\n\n", call], [])
    r = llm.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[tool])
    assert r.tool_calls and r.tool_calls[0]["function"]["name"] == "get_weather"
    assert len(r.tool_calls) == 1 and "I could write" in r.reasoning
    llm = _scripted_llm(qwen_tok, ["<think>\n" + call + "\n</think>\n\nNo call."], [])
    r = llm.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[tool])
    assert not r.tool_calls and r.text == "No call."


# ---- the server ------------------------------------------------------------------------------

class _ScriptedEngine:
    """Engine.submit_requests' contract, answering every request with the same pieces."""

    def __init__(self, pieces):
        self.pieces, self.prompts = pieces, []

    def has_room(self, n=1):
        return True

    def submit_requests(self, reqs, prompt_logprobs=False, cache_partition=None):
        from pyklei.runtime.generate import GenerationResponse

        self.prompts.append(list(reqs[0].prompt))
        pieces, n = self.pieces, len(reqs[0].prompt)

        class Stream:
            id = "scripted"

            def cancel(self):
                pass

            def __iter__(self):
                for k, text in enumerate(pieces):
                    yield GenerationResponse(
                        text=text, token=1, finish_reason="stop" if k == len(pieces) - 1 else None,
                        prompt_tokens=n, prompt_eval_tokens=n, generation_tokens=k + 1,
                        time_to_first_token=0.01, prompt_tps=1.0, generation_tps=1.0, peak_rss_mb=1.0)
        return [Stream() for _ in reqs]


@pytest.fixture()
def served(qwen_tok):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyklei.server.app import create_app

    engine = _ScriptedEngine(["<think>\nThe user", " greets me.\n</think>", "\n\nHello", "!"])
    with TestClient(create_app(engine, qwen_tok, "qwen3", n_ctx=4096)) as client:
        yield client, engine


def test_server_chat_reply_has_reasoning_content_and_reasoning(served):
    client, engine = served
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": ASK})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Hello!"
    assert msg["reasoning_content"] == msg["reasoning"] == "The user greets me."


def test_server_streams_reasoning_deltas_apart_from_content(served):
    client, _ = served
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "qwen3", "messages": ASK, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert content == "Hello!" and reasoning == "The user greets me."
    assert reasoning == "".join(d.get("reasoning") or "" for d in deltas)
    assert not any("think>" in (d.get("content") or "") for d in deltas)


def test_server_passes_chat_template_kwargs_to_the_template(served, qwen_tok):
    client, engine = served
    body = {"model": "qwen3", "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert qwen_tok.decode(engine.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert client.post("/v1/chat/completions", json={"model": "qwen3", "messages": ASK}).status_code == 200
    assert not qwen_tok.decode(engine.prompts[-1]).endswith("</think>\n\n")
    for bad in ([1], {"add_generation_prompt": False}, {"not a name": 1}):
        r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
