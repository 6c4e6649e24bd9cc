"""Tool calling (pyklei.tools): tools and tool messages rendered by a template that knows tools
and by pyklei's fallback for one that does not, replies parsed into OpenAI tool_calls, and the
schema of a call. The server round trip is in tests/test_openai_tools.py."""
import json

import pytest

from pyklei.tokenizer import Tokenizer
from pyklei.tools import (ToolError, call_schema, check_tool_choice, check_tools, knows_tools,
                          may_start_a_call, parse_reply, render, template_messages)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>'
     '{"name": "b", "arguments": {"x": 1}}</tool_call>', "Let me look.",
     [("a", {}), ("b", {"x": 1})]),
    ('<tool_call>{"name": "a", "arguments": {"k": "v"}}', None, [("a", {"k": "v"})]),  # cut
    ('{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),           # Llama 3.x
    ('[{"name": "a", "parameters": {"q": 1}}, {"name": "b", "arguments": {}}]', None,
     [("a", {"q": 1}), ("b", {})]),
    ('{"answer": 42}', '{"answer": 42}', []),                          # JSON, but not a call
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "a", "ar',
     None, [("a", {})]),                   # a second call cut by max_tokens: dropped
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_parse_reply(text, content, calls):
    got_content, got = parse_reply(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def test_may_start_a_call():
    assert may_start_a_call("") and may_start_a_call("  {") and may_start_a_call("<tool")
    assert may_start_a_call("<tool_call>{\"na") and may_start_a_call("[")
    assert not may_start_a_call("Hello") and not may_start_a_call("<b>")


def test_checks_name_the_field():
    assert check_tools([WEATHER, TIME]) == [WEATHER, TIME]
    for bad in ([{"type": "function"}], [{"type": "code", "function": {"name": "x"}}],
                [{"type": "function", "function": {"name": "a b"}}], [WEATHER, WEATHER],
                [{"type": "function", "function": {"name": "x", "parameters": []}}], "x"):
        with pytest.raises(ToolError):
            check_tools(bad)
    assert check_tool_choice(None, [WEATHER]) == "auto" and check_tool_choice(None, []) == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, [WEATHER]) == named
    with pytest.raises(ToolError, match="not one of the tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(ToolError, match="needs 'tools'"):
        check_tool_choice("required", [])


def test_call_schema():
    import jsonschema

    one = call_schema([WEATHER, TIME], name="get_weather")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {}}, one)   # city required
    many = call_schema([WEATHER, TIME], parallel=True)
    jsonschema.validate([{"name": "get_time", "arguments": {}},
                         {"name": "get_weather", "arguments": {"city": "Rome"}}], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)


def test_fallback_rendering_for_a_template_without_tools(smollm2_q4):
    tok = Tokenizer.from_gguf(smollm2_q4)
    assert not knows_tools(tok.chat_template)
    text = tok.decode(render(tok, TURNS, [WEATHER]))
    assert '"name": "get_weather"' in text and "<tool_call>" in text     # tools described
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert text.rstrip().endswith("assistant")


def test_a_template_that_knows_tools_gets_them_in_the_hugging_face_shape():
    native = template_messages(TURNS, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[1]["content"] == "" and native[2]["role"] == "tool"

    class Tok:      # a tokenizer whose template renders tools and calls as JSON lines
        chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                         "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
                         "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")

        def apply_chat_template(self, msgs, add_generation_prompt, tokenize, **kw):
            from pyklei.chat_template import render as render_template
            return render_template(self.chat_template, msgs, add_generation_prompt, **kw)

    assert knows_tools(Tok.chat_template)
    out = render(Tok(), TURNS, [WEATHER])
    assert out.startswith("TOOL get_weather\n")
    assert 'CALL get_weather {"city": "Paris"}' in out and "tool: {\"temp\": 21}" in out


def test_llm_chat_with_tools_round_trip(smollm2_q4):
    """The Python API: a forced call parsed into response.tool_calls, then the result in a tool
    message and a reply in text."""
    pytest.importorskip("llguidance")
    import jsonschema

    import pyklei

    llm = pyklei.load(smollm2_q4, n_threads=2, n_ctx=1024)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = llm.chat(ask, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, temperature=0, max_tokens=60)
    assert r.finish_reason == "tool_calls" and r.text == "" and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    r = llm.chat(ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "12 C, rain"}],
                 tools=[WEATHER, TIME], temperature=0, max_tokens=30)
    assert r.tool_calls is None and r.text
    with pytest.raises(ToolError, match="not one of the tools"):
        llm.chat(ask, tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "get_time"}})
