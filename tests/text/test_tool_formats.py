"""Each family's tool-call format (pyklei.text.tool_calls): chosen from the chat template, read
back from what the family's real template writes for an assistant's calls, streamed whole, and
written by the grammar of forced calls; tool schemas whose $defs survive the move under
"arguments". The server round trips are in tests/server/test_openai_tools.py."""
import json

import pytest

from chat_templates import QWEN3_CHAT_TEMPLATE
from tool_stream import stream_as_server
from tool_templates import LLAMA32_TEMPLATE, MINISTRAL_3_TEMPLATE, MISTRAL_SMALL_31_TEMPLATE
from pyklei.text.chat_template import render
from pyklei.text.json_schema import close_objects, hoist_defs
from pyklei.text.reasoning import Reasoning
from pyklei.text.tool_calls import (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_LIST, call_format,
                                    call_schema, forced_calls, reply_parser, template_messages)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = {"role": "user", "content": "Weather in Paris and the time in Tokyo?"}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Asia/Tokyo"})]
# template, its format, its end-of-turn text, whether it takes several calls in one message
FAMILIES = {
    "qwen3": (QWEN3_CHAT_TEMPLATE, HERMES, "<|im_end|>\n", True),
    "mistral-small-3.1": (MISTRAL_SMALL_31_TEMPLATE, MISTRAL_LIST, "</s>", True),
    "ministral-3": (MINISTRAL_3_TEMPLATE, MISTRAL, "</s>", True),
    "llama-3.2": (LLAMA32_TEMPLATE, LLAMA3_JSON, "<|eot_id|>", False),
}


def _assistant_text(template, calls, eot):
    """What the family's template writes for an assistant turn with these calls: the render
    of the conversation with the turn, less the render of the prompt before it."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{k:09d}", "type": "function",
         "function": {"name": n, "arguments": json.dumps(a)}} for k, (n, a) in enumerate(calls)]}
    kw = dict(tools=[WEATHER, TIME], bos_token="<s>", eos_token="</s>",
              date_string="26 Jul 2024")
    prompt = render(template, template_messages([ASK], True), add_generation_prompt=True, **kw)
    whole = render(template, template_messages([ASK, turn], True), add_generation_prompt=False,
                   **kw)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    assert text.endswith(eot)
    # Qwen3's template writes an empty thinking part in the turn; the reply's reasoning is
    # split off before its calls are read (pyklei.text.reasoning), as the server does
    return Reasoning().split(text[:-len(eot)])[1]


def _calls(got):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reads_back_the_calls_its_template_writes(family):
    template, fmt, eot, several = FAMILIES[family]
    assert call_format(template) is fmt
    parser = reply_parser([WEATHER, TIME], template, [ASK])
    for calls in ([CALLS[0]], CALLS) if several else ([CALLS[0]],):
        text = _assistant_text(template, calls, eot)
        content, got = parser.parse(text)
        assert _calls(got) == calls and content is None, text
        # the same calls after some content, where the format allows content before them
        if fmt is not LLAMA3_JSON:
            content, got = parser.parse("Let me check. " + text)
            assert content == "Let me check." and _calls(got) == calls
    # an undeclared name is content, the text intact
    text = _assistant_text(template, [("rm_rf", {})], eot)
    assert parser.parse(text) == (text, [])


@pytest.mark.parametrize("fmt, text, calls", [
    # older Mistral: one object instead of a list; a list cut after whole calls
    (MISTRAL_LIST, '[TOOL_CALLS] {"name": "get_time", "arguments": {}}', [("get_time", {})]),
    (MISTRAL_LIST, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_we',
     None),
    (MISTRAL_LIST, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}', [("get_time", {})]),
    # v11: a call id between the name and the arguments; a last call cut by max_tokens
    (MISTRAL, '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}',
     [("get_time", {"zone": "UTC"})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"ci',
     [("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{} and then some words', None),
    # Llama 3.x: after <|python_tag|>, and several separated by ';' (vLLM's llama3_json)
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_time", "parameters": {}}', [("get_time", {})]),
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                  '"parameters": {"city": "Oslo"}}', [("get_time", {}),
                                                      ("get_weather", {"city": "Oslo"})]),
    # repeats are one call, in every format
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>'
             '{"name": "get_time", "arguments": {}}</tool_call>', [("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_time[ARGS]'
              '{ "zone":"UTC" }', [("get_time", {"zone": "UTC"})]),
])
def test_format_details(fmt, text, calls):
    from pyklei.text.tool_calls import CallParser
    parser = CallParser(frozenset({"get_time", "get_weather"}), fmt)
    content, got = parser.parse(text)
    if calls is None:
        assert (content, got) == (text, [])
    else:
        assert _calls(got) == calls

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_streamed_call_comes_whole(family, step):
    """No piece of a call's markup is ever sent as content; the calls are the whole reply's."""
    template, fmt, eot, several = FAMILIES[family]
    parser = reply_parser([WEATHER, TIME], template, [ASK])
    prefix = "" if fmt is LLAMA3_JSON else "Checking. "
    text = prefix + _assistant_text(template, CALLS if several else CALLS[:1], eot)
    pieces, calls, _ = stream_as_server(parser, text, step)
    sent = "".join(pieces)
    assert _calls(calls) == (CALLS if several else CALLS[:1])
    assert sent == prefix[:len(sent)] and not any(m in sent for m in ("<", "[", "{"))


def _pydantic_tool():
    openai = pytest.importorskip("openai")
    from pet_models import PetWithHistory

    return openai.pydantic_function_tool(PetWithHistory, name="Pet")


def test_a_tools_defs_are_carried_to_the_root_of_the_call_schema():
    jsonschema = pytest.importorskip("jsonschema")
    pet = _pydantic_tool()
    # a second tool with its own, different "Owner"; and a recursive one (a "#" ref)
    other = {"type": "function", "function": {"name": "adopt", "parameters": {
        "$defs": {"Owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                            "required": ["id"]}},
        "type": "object", "properties": {"owner": {"$ref": "#/$defs/Owner"}},
        "required": ["owner"]}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    schema = call_schema([pet, other, tree])
    good = [{"name": "Pet", "arguments": {"species": "dog", "owner": {"name": "A", "email": "a@b"},
                                          "previous": [{"name": "B", "email": "b@c"}]}},
            {"name": "adopt", "arguments": {"owner": {"id": 3}}},
            {"name": "tree", "arguments": {"kids": [{"kids": [{}]}]}}]
    for g in good:
        jsonschema.validate(g, schema)
    bad = [{"name": "Pet", "arguments": {"species": "dog", "owner": {"id": 3}}},
           {"name": "adopt", "arguments": {"owner": {"name": "A", "email": "a@b"}}},
           {"name": "tree", "arguments": {"kids": [{"kids": [{"x": 1}]}]}},     # closed
           {"name": "Pet", "arguments": {"species": "dog", "owner": {       # nested: closed
               "name": "A", "email": "a@b", "age": 3}}}]
    for b in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(b, schema)


def test_hoist_defs_and_close_objects():
    body, defs = hoist_defs({"definitions": {"a/b": {"type": "integer"}}, "type": "object",
                             "properties": {"x": {"$ref": "#/definitions/a~1b"},
                                            "y": {"const": {"$ref": "#/not/a/ref"}}}}, "t.")
    assert body["properties"]["x"] == {"$ref": "#/$defs/t.a~1b"} and "definitions" not in body
    assert body["properties"]["y"] == {"const": {"$ref": "#/not/a/ref"}}   # data, untouched
    assert defs == {"t.a/b": {"type": "integer"}}
    nested = close_objects({"type": "object", "properties": {"o": {
        "type": "object", "properties": {"k": {"type": "string"}}}},
        "$defs": {"D": {"properties": {"z": {}}}}})
    assert nested["properties"]["o"]["additionalProperties"] is False
    assert nested["$defs"]["D"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_q4):
    from pyklei.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_q4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_forced_grammar_writes_the_familys_format(family, smollm2_tokenizer):
    """The text each family's template writes for its calls is a sentence of the grammar of
    forced calls for that family (markers as text here: SmolLM2's vocabulary lacks them)."""
    llg = pytest.importorskip("llguidance")
    from pyklei.runtime.grammar import _JSON_LAYOUT, llg_tokenizer
    template, fmt, eot, several = FAMILIES[family]
    tok = smollm2_tokenizer
    for calls, parallel in (([CALLS[0]], False), (CALLS, True)):
        if len(calls) > 1 and not several:
            continue
        text = _assistant_text(template, calls, eot)
        if fmt is MISTRAL_LIST:   # the template adds ids to the calls of its history; a model
            text = "[TOOL_CALLS] [" + ", ".join(   # writes them without (Mistral's examples)
                json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"
        forced = forced_calls([WEATHER, TIME], "required", parallel, template)
        m = llg.LLMatcher(llg_tokenizer(tok), forced.lark(tok, _JSON_LAYOUT))
        ids = tok.encode(text, add_bos=False, parse_special=False)
        assert m.consume_tokens(ids) and m.is_accepting(), (text, m.get_error())
    # a tool with $defs compiles in every format (its refs resolve where the format puts it)
    forced = forced_calls([_pydantic_tool(), WEATHER], "required", True, template)
    bad, msgs = llg.LLMatcher.validate_grammar_with_warnings(forced.lark(tok, _JSON_LAYOUT),
                                                             llg_tokenizer(tok))
    assert not bad, msgs


def test_the_closing_search_passes_a_marker_that_is_a_special_token(smollm2_tokenizer):
    """Mistral's [TOOL_CALLS] is a control token: the grammar names it as one (`<[id]>`), and
    the search that keeps a forced call within max_tokens steps over it (SmolLM2's
    <|im_start|> stands in for it here)."""
    pytest.importorskip("llguidance")
    from pyklei.runtime.grammar import JSON_START, _compile, completion_within
    tok = smollm2_tokenizer
    marker = tok.token_to_id("<|im_start|>")
    c = _compile(tok, f'start: <[{marker}]> "get_time" %json {{"type": "object", "properties": '
                      f'{{"zone": {{"type": "string"}}}}, "required": ["zone"]}}', "tool calls")
    path = completion_within(c._matcher, tok, JSON_START, 40)
    assert path and path[0] == marker
    assert tok.decode(path[1:]).replace(" ", "") == 'get_time{"zone":""}'
