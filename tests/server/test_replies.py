"""The Responses and Messages APIs' reply builders on scripted engine output (no model): a
thinking model's reply becomes a reasoning item / thinking block before the answer, a tool call
a function_call item / tool_use block, streamed events and the whole reply agree, and the stop
sequence that ended a reply is named."""
from types import SimpleNamespace

from pyklei.runtime.generate import GenerationResponse
from pyklei.server.messages_api import MessageBuilder
from pyklei.server.replies import ReplySplitter, stop_sequence
from pyklei.server.responses_api import ResponseBuilder, ResponseStore, Turn
from pyklei.text.reasoning import Reasoning
from pyklei.text.tool_calls import reply_parser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class Tok:
    eos_ids = (0,)

    def encode(self, text):
        return text.split()

    def token_to_piece(self, token):
        return {7: b"Blue", 8: b" sky"}[token]


def responses(texts, finish="stop", token=None):
    out = []
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        out.append(GenerationResponse(t, token if last else 5, finish if last else None, 10, 8,
                                      i + 1, 0.1, 100.0, 10.0, 1.0))
    return out


def req(reasoning=None, tools=(), stop=()):
    calls = reply_parser(list(tools), None) if tools else None
    return SimpleNamespace(reasoning=reasoning, calls=calls, stop=stop, constraint=None)


def run(builder, r, texts, **kw):
    split, events = ReplySplitter(r), []
    for g in responses(texts, **kw):
        for p in split.feed(g):
            events += builder.feed(p)
    return events


THINKING = ["<think>", "\nLet me ", "think.</", "think>\n\nThe answer", " is 4."]


def test_a_thinking_reply_is_a_reasoning_item_then_the_message():
    b = ResponseBuilder(Turn("resp_1", {}, [], []), "m", Tok())
    events = b.begin() + run(b, req(Reasoning()), THINKING)
    obj = b.finish()
    assert [o["type"] for o in obj["output"]] == ["reasoning", "message"]
    assert obj["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert obj["output"][1]["content"][0]["text"] == "The answer is 4."
    assert obj["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert obj["usage"]["input_tokens_details"]["cached_tokens"] == 2
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.index(
        "response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") \
        == "Let me think."
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert b.conversation() == [{"role": "assistant", "content": "The answer is 4."}]


def test_a_thinking_reply_is_a_thinking_block_then_text():
    b = MessageBuilder(req(Reasoning()), "m", Tok())
    events = run(b, b.req, THINKING)
    msg = b.whole()
    assert msg["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                              {"type": "text", "text": "The answer is 4."}]
    assert msg["stop_reason"] == "end_turn"
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert any(e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
               for e in events)
    assert msg["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 2, "output_tokens": len(THINKING)}


def test_a_call_is_a_function_call_item_and_a_tool_use_block():
    texts = ["Sure. <tool", '_call>{"name": "f", "arguments": {"x": 1}}</tool_call>']
    b = ResponseBuilder(Turn("resp_1", {}, [], []), "m", Tok())
    run(b, req(tools=TOOLS), texts)
    out = b.finish()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Sure. "
    assert out[1]["name"] == "f" and out[1]["arguments"] == '{"x": 1}'
    assert b.conversation()[0]["tool_calls"][0]["id"] == out[1]["call_id"]
    m = MessageBuilder(req(tools=TOOLS), "m", Tok())
    events = run(m, m.req, texts)
    msg = m.whole()
    assert msg["stop_reason"] == "tool_use" and msg["content"][1]["input"] == {"x": 1}
    assert msg["content"][1]["id"].startswith("toolu_")
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "input_json_delta"] == ['{"x": 1}']


def test_an_empty_reply_is_an_empty_message():
    b = ResponseBuilder(Turn("resp_1", {}, [], []), "m", Tok())
    run(b, req(), [""], token=0)
    assert b.finish()["output"][0]["content"][0]["text"] == ""


def test_the_stop_sequence_that_ended_a_reply():
    tok = Tok()
    [last] = responses(["Blu"], token=7)
    assert stop_sequence(last, ("zz", "e"), tok, False, "Blu") == "e"
    assert stop_sequence(last, ("ue",), tok, False, "Bl") == "ue"
    [eos] = responses(["Blue"], token=0)
    assert stop_sequence(eos, ("e",), tok, False, "Blue") is None
    [cut] = responses(["Blue"], finish="length", token=7)
    assert stop_sequence(cut, ("e",), tok, False, "Blu") is None


def test_a_reply_cut_by_the_drain_deadline_is_incomplete():
    b = ResponseBuilder(Turn("resp_1", {}, [], []), "m", Tok())
    run(b, req(), ["Once upon"], finish="cancelled")
    obj = b.finish()
    assert obj["status"] == "incomplete" and obj["incomplete_details"] == {"reason": "cancelled"}
    m = MessageBuilder(req(), "m", Tok())
    run(m, m.req, ["Once upon"], finish="cancelled")
    assert m.whole()["stop_reason"] == "cancelled"


def test_a_failure_mid_stream_ends_the_stream_in_each_api_shape():
    import asyncio
    import json

    from pyklei.runtime.engine import RequestFailedError
    from pyklei.server import messages_api, responses_api

    async def failing():
        for p in ReplySplitter(req()).feed(responses(["Hi"], finish=None)[0]):
            yield p
        raise RequestFailedError("logits turned non-finite")

    s = SimpleNamespace(model_id="m", tokenizer=Tok(), responses=ResponseStore())

    async def events(front, turn):
        return [json.loads(e.split(b"data: ", 1)[1])
                async for e in front.stream(s, req(), turn, failing())]

    out = asyncio.run(events(responses_api.Front, Turn("resp_1", {}, [], [])))
    assert out[-1]["type"] == "response.failed"
    assert "non-finite" in out[-1]["response"]["error"]["message"]
    assert out[-1]["response"]["status"] == "failed"
    assert s.responses.get(None, "resp_1") is None           # a failed response is not stored
    out = asyncio.run(events(messages_api.Front, None))
    assert [e["type"] for e in out][:2] == ["message_start", "ping"]
    assert out[-1] == {"type": "error", "error": {"type": "api_error", "message":
                                                  "RequestFailedError: logits turned non-finite"}}


def test_the_store_is_bounded_in_count_and_age_and_kept_per_tenant():
    store = ResponseStore(max_items=2, ttl_s=60)
    for i in range(3):
        store.put("a", f"r{i}", [], {"id": f"r{i}"})
    assert store.get("a", "r0") is None and store.get("a", "r2") is not None
    assert store.get("b", "r2") is None
    old = ResponseStore(max_items=10, ttl_s=0)
    old.put("a", "r", [], {})
    assert old.get("a", "r") is None
