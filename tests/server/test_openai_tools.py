"""Structured outputs and tool calling through `pyklei serve` (issue 23), as applications use
them: the official openai client (a tool round trip, streamed and not; response_format
json_schema and json_object; llama.cpp's grammar field) and langchain-openai's
with_structured_output and bind_tools. SmolLM2 in a real server subprocess; the constraint
(llguidance) is what makes a 135M model's replies valid."""
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)
from api_bodies import PERSON  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_q4):
    with LiveServer(smollm2_q4, "--parallel", "2", ctx=2048, threads=2) as srv:
        yield srv


def client(srv):
    return srv.openai_client()


def _arguments_valid(call, tool):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(server, stream):
    c = client(server)
    kw = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              temperature=0, max_tokens=80)
    if stream:
        chunks = list(c.chat.completions.create(**kw, stream=True))
        last = [ch for ch in chunks if ch.choices][-1].choices[0]
        assert last.finish_reason == "tool_calls"
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].index == 0 and deltas[0].id.startswith("call_")
        call = openai.types.chat.ChatCompletionMessageFunctionToolCall(
            id=deltas[0].id, type="function",
            function={"name": deltas[0].function.name, "arguments": "".join(
                d.function.arguments for d in deltas if d.index == 0)})
    else:
        r = c.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
    tool = WEATHER if call.function.name == "get_weather" else TIME
    _arguments_valid(call, tool)
    answer = c.chat.completions.create(model="m", tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=40, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}])
    msg = answer.choices[0].message
    assert msg.content or msg.tool_calls


def test_a_named_tool_is_called_with_valid_arguments(server):
    r = client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What time is it in Berlin?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.8, seed=4, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
    assert all(cl.function.name == "get_time" for cl in calls)
    assert _arguments_valid(calls[0], TIME)["zone"] in ("UTC", "CET", "PST")


def test_tool_choice_none_and_bad_tools(server):
    c = client(server)
    r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    for kw, param in [({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                       "tools"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                            "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tools": [WEATHER], "tool_choice": "required",
                        "response_format": {"type": "json_object"}}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_response_format_json_schema_validates(server, seed):
    r = client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                "schema": PERSON}},
        temperature=0 if seed is None else 0.8, seed=seed, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_llama_cpp_grammar_fields(server):
    c = client(server)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Is the sky "
                                  "blue? Answer yes or no."}], temperature=0, max_tokens=10,
                                  extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Any JSON."}],
                                  temperature=0, max_tokens=10,
                                  extra_body={"json_schema": {"type": "integer"}})
    assert isinstance(json.loads(r.choices[0].message.content), int)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format" and "nonsense" in e.value.body["message"]


def test_langchain_structured_output_and_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    chat = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2",
                         temperature=0, max_tokens=120, max_retries=0)
    p = chat.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(p, Person)
    tool_chat = chat.bind_tools([WEATHER], tool_choice="get_weather")
    msg = tool_chat.invoke("What is the weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def test_the_legacy_functions_api(server):
    """functions / function_call (llama-cpp-python still takes them): a forced call comes back
    as message.function_call, streamed too, and a role "function" result is answered."""
    c = client(server)
    fn = [WEATHER["function"]]
    kw = dict(model="m", messages=ASK, functions=fn, function_call={"name": "get_weather"},
              temperature=0, max_tokens=60)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "function_call" and ch.message.tool_calls is None
    jsonschema.validate(json.loads(ch.message.function_call.arguments),
                        WEATHER["function"]["parameters"])
    last = [x for x in c.chat.completions.create(**kw, stream=True) if x.choices][-1].choices[0]
    assert last.finish_reason == "function_call"
    assert last.delta.function_call.arguments == ch.message.function_call.arguments
    answer = c.chat.completions.create(model="m", functions=fn, temperature=0, max_tokens=30,
                                       messages=ASK + [
        {"role": "assistant", "content": None, "function_call": ch.message.function_call.model_dump()},
        {"role": "function", "name": "get_weather", "content": "21 C"}])
    assert answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=ASK, functions=fn, tools=[WEATHER])
    assert e.value.body["param"] == "functions"


# ---- issue 43: forced calls that never break ----------------------------------------------------

OWNER = {"type": "object", "properties": {"name": {"type": "string"},
                                          "email": {"type": "string"}},
         "required": ["name", "email"]}
REGISTER = {"type": "function", "function": {     # not strict: no additionalProperties anywhere
    "name": "register_pet", "description": "Register a pet and its owner",
    "parameters": {"type": "object", "properties": {"species": {"type": "string"},
                                                    "owner": OWNER},
                   "required": ["species", "owner"]}}}
PET_ASK = [{"role": "user", "content": "Register my dog Rex; the owner is Ann, ann@x.org."}]


def _pydantic_pet_tool():
    from pet_models import Pet

    return openai.pydantic_function_tool(Pet)


def _closed(schema):
    from pyklei.text.json_schema import close_objects
    return close_objects(schema)


@pytest.mark.parametrize("max_tokens", [60, 100, 200])
@pytest.mark.parametrize("kind", ["pydantic", "open"])
def test_a_forced_call_with_a_nested_schema_is_one_valid_call_within_max_tokens(
        server, max_tokens, kind):
    """A tool whose parameters nest a model ($defs / $ref from pydantic, or an inline object
    without additionalProperties) comes back as exactly one call whose arguments validate,
    every object closed, within max_tokens, named or "required" (issue 43, items 4 and 5)."""
    tool = _pydantic_pet_tool() if kind == "pydantic" else REGISTER
    name = tool["function"]["name"]
    params = tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": name}}):
        r = client(server).chat.completions.create(
            model="m", messages=PET_ASK, tools=[tool], tool_choice=choice, temperature=0,
            max_tokens=max_tokens, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        assert r.usage.completion_tokens <= max_tokens
        args = json.loads(ch.message.tool_calls[0].function.arguments)
        jsonschema.validate(args, params)
        jsonschema.validate(args, _closed(params))   # no invented keys at any level


def test_required_never_repeats_a_call(server):
    """With parallel calls allowed, a reply never holds the same call twice (issue 43, item 6:
    get_weather {"city": "Rome"} came five times); with parallel_tool_calls false, one call."""
    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    for seed in (None, 1, 2, 3):
        r = c.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME],
                                      tool_choice="required", max_tokens=200, seed=seed,
                                      temperature=0 if seed is None else 0.9)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        keys = [(cl.function.name, json.dumps(json.loads(cl.function.arguments), sort_keys=True))
                for cl in calls]
        assert len(set(keys)) == len(keys), keys
        one = c.chat.completions.create(model="m", messages=ask, tools=[WEATHER, TIME],
                                        tool_choice="required", max_tokens=200, seed=seed,
                                        temperature=0 if seed is None else 0.9,
                                        parallel_tool_calls=False)
        assert len(one.choices[0].message.tool_calls) == 1


def test_a_streamed_forced_call_leaks_no_markup(server):
    """A streamed forced call comes whole in its tool_calls delta; no content delta carries any
    of its markup."""
    chunks = list(client(server).chat.completions.create(
        model="m", messages=PET_ASK, tools=[_pydantic_pet_tool()], tool_choice="required",
        temperature=0, max_tokens=100, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert "<tool" not in content and "{" not in content
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and json.loads(deltas[0].function.arguments)["owner"]


def test_langchain_function_calling_structured_output_with_a_nested_model(server):
    """with_structured_output(method="function_calling") forces a call of a tool made from a
    nested pydantic model: it returned None when the call broke (issue 43, item 5)."""
    lc = pytest.importorskip("langchain_openai")
    from pet_models import Owner, Pet

    chat = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2",
                         temperature=0, max_tokens=100, max_retries=0)
    pet = chat.with_structured_output(Pet, method="function_calling").invoke(PET_ASK[0]["content"])
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner)
