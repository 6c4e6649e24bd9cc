"""Anthropic's Messages API through `pyklei serve` (issue 43), as applications use it: the official
anthropic client's `messages.create` and `messages.stream` with text, stop sequences and tools (a
tool_use -> tool_result round trip, tool_choice any / tool / none), `count_tokens`, errors in
Anthropic's shape, and the key sent as x-api-key. SmolLM2 in a real server subprocess with two
API keys; the grammar (llguidance) is what makes a 135M model's forced calls valid."""
import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
from api_bodies import PERSON  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                         "required": ["zone"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
COLOUR = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}      # the anthropic client (2.x) has no sampling arguments of its own


@pytest.fixture(scope="module")
def server(two_key_server):
    return two_key_server


def client(srv, key="key-a"):
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def test_text_whole_and_streamed_agree(server):
    c = client(server)
    kw = dict(model="m", max_tokens=40, extra_body=GREEDY, system="Answer in one short sentence.",
              messages=COLOUR)
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 40
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    # the prompt: counted alike by count_tokens and by usage (ran + read from the cache)
    n = c.messages.count_tokens(model="m", system=kw["system"], messages=COLOUR).input_tokens
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    system_blocks = c.messages.count_tokens(model="m", messages=COLOUR, system=[
        {"type": "text", "text": "Answer in one short sentence."}]).input_tokens
    assert system_blocks == n


def test_the_raw_event_sequence(server):
    body = {"model": "m", "max_tokens": 3, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": "key-b", "anthropic-version": "2023-06-01"}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    deltas = names.count("content_block_delta")
    assert names == (["message_start", "ping", "content_block_start"]
                     + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"]), names
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens"
    assert datas[-2]["usage"]["output_tokens"] == 3


def test_stop_sequences(server):
    m = client(server).messages.create(model="m", max_tokens=60, extra_body=GREEDY,
                                       messages=COLOUR, stop_sequences=["zzz", "e"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "e"
    assert "e" not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(server, stream):
    c = client(server)
    kw = dict(model="m", max_tokens=80, extra_body=GREEDY, messages=ASK, tools=[WEATHER, TIME],
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    if stream:
        with c.messages.stream(**kw) as s:
            kinds = [e.type for e in s]
            m = s.get_final_message()
        assert "input_json" in kinds
    else:
        m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    jsonschema.validate(use.input, (WEATHER if use.name == "get_weather" else TIME)["input_schema"])
    answer = c.messages.create(model="m", max_tokens=40, extra_body=GREEDY, tools=[WEATHER, TIME],
                               messages=ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"temp_c": 21})}]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_named_tool_and_none(server):
    c = client(server)
    m = c.messages.create(model="m", max_tokens=60, extra_body={"temperature": 0.8}, messages=[
        {"role": "user", "content": "What time is it in Berlin?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and all(u.name == "get_time" for u in uses)
    assert uses[0].input["zone"] in ("UTC", "CET")
    m = c.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                          tool_choice={"type": "none"})
    assert all(b.type == "text" for b in m.content) and m.stop_reason != "tool_use"


def test_an_output_format_json_schema(server):
    m = client(server).messages.create(
        model="m", max_tokens=120, messages=[{"role": "user", "content": "Describe a person."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body={"temperature": 0.8})
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


@pytest.mark.parametrize("kw, says", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    ({"temperature": -1}, "temperature"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format"),
])
def test_bad_requests_are_400s_in_anthropic_shape(server, kw, says):
    body = {"model": "m", "max_tokens": 4, "messages": COLOUR, **kw}
    r = httpx.post(server.url + "/v1/messages", json={k: v for k, v in body.items()
                                                      if v is not None},
                   headers={"x-api-key": "key-a"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert says in err["error"]["message"], err


def test_keys_by_x_api_key_and_errors_through_the_client(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong").messages.create(model="m", max_tokens=2, messages=COLOUR)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model="m", max_tokens=2, messages=[])
    assert "messages" in e.value.body["error"]["message"]
    assert client(server, "key-b").messages.create(model="m", max_tokens=2,
                                                   messages=COLOUR).usage.output_tokens <= 2
