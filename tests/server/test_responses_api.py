"""OpenAI's Responses API through `pyklei serve` (issue 43), as applications use it: the official
openai client's `responses.create`, streamed and not, with instructions, a JSON schema, a
function tool round trip (function_call -> function_call_output -> text) both by
previous_response_id and by sending the items back, stored responses per tenant, and the OpenAI
Agents SDK's run loop with a function tool. SmolLM2 in a real server subprocess with two API keys
(two tenants); the grammar (llguidance) is what makes a 135M model's calls and JSON valid."""
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
from api_bodies import PERSON  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

WEATHER = {"type": "function", "name": "get_weather",
           "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
ITEM_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(two_key_server):
    return two_key_server


def client(srv, key="key-a"):
    return srv.openai_client(api_key=key)


def test_text_whole_and_streamed_agree_and_events_come_in_order(server):
    c = client(server)
    kw = dict(model="m", instructions="Answer in one short sentence.", input="Name a colour.",
              temperature=0, max_output_tokens=40)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 40
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = sum(k == "response.output_text.delta" for k in kinds)
    assert kinds == (["response.created", "response.in_progress"] + ITEM_EVENTS[:2]
                     + ["response.output_text.delta"] * deltas + ITEM_EVENTS[3:]
                     + ["response.completed"]), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(server):
    c = client(server)
    r = c.responses.create(model="m", input="Tell me a long story.", max_output_tokens=3,
                           temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    last = list(c.responses.create(model="m", input="Tell me a long story.", stream=True,
                                   max_output_tokens=3, temperature=0))[-1]
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_and_json_object(server, stream):
    c = client(server)
    kw = dict(model="m", input="Describe a person as JSON.", max_output_tokens=120,
              temperature=0.8, text={"format": {"type": "json_schema", "name": "person",
                                                "schema": PERSON, "strict": True}})
    if stream:
        text = list(c.responses.create(**kw, stream=True))[-1].response.output_text
    else:
        text = c.responses.create(**kw).output_text
    jsonschema.validate(json.loads(text), PERSON)
    r = c.responses.create(model="m", input="Any JSON object.", max_output_tokens=60,
                           temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


def _call(c, stream, **kw):
    kw = dict(model="m", input="What is the weather in Paris?", tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, temperature=0,
              max_output_tokens=80, **kw)
    if not stream:
        return c.responses.create(**kw)
    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"], kinds
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_round_trip(server, stream):
    c = client(server)
    r = _call(c, stream)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temp_c": 21, "sky": "sunny"})}
    # by the stored response
    answer = c.responses.create(model="m", previous_response_id=r.id, input=[result],
                                tools=[WEATHER], temperature=0, max_output_tokens=60)
    assert answer.output[-1].type in ("message", "function_call")
    assert answer.previous_response_id == r.id
    # statelessly, every item sent back (as the Agents SDK does with store=False)
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             call.model_dump(exclude_none=True), result]
    again = c.responses.create(model="m", input=items, tools=[WEATHER], temperature=0,
                               max_output_tokens=60, store=False)
    # the same conversation either way, so the same prompt
    assert again.usage.input_tokens == answer.usage.input_tokens
    assert [o.type for o in again.output] == [o.type for o in answer.output]


def test_previous_response_id_stores_per_tenant(server):
    c = client(server)
    first = c.responses.create(model="m", input="My name is Ada. Say hello.", temperature=0,
                               max_output_tokens=20)
    second = c.responses.create(model="m", previous_response_id=first.id, input="What is my name?",
                                temperature=0, max_output_tokens=20)
    # the second prompt holds the first turn, its reply and the new question
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    got = httpx.get(f"{server.url}/v1/responses/{first.id}",
                    headers={"Authorization": "Bearer key-a"}).json()
    assert got["id"] == first.id and got["output"][0]["content"][0]["text"] == first.output_text
    # another tenant sees none of it
    other = client(server, "key-b")
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model="m", previous_response_id=first.id, input="Who am I?")
    assert e.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{server.url}/v1/responses/{first.id}",
                     headers={"Authorization": "Bearer key-b"}).status_code == 404
    # store=False keeps nothing; a deleted response is gone
    unstored = c.responses.create(model="m", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="m", previous_response_id=unstored.id, input="Again")
    assert c.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


@pytest.mark.parametrize("kw, param", [
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": -1}, "temperature"),
])
def test_bad_requests_are_400s_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).responses.create(model="m", **kw)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_without_a_key_it_is_a_401(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").responses.create(model="m", input="Hi")


def test_the_agents_sdk_runs_a_function_tool(server):
    agents = pytest.importorskip("agents")
    import asyncio
    agents.set_tracing_disabled(True)
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is 21 C and sunny in {city}."

    model = agents.OpenAIResponsesModel(model="smollm2", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="key-a", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Use the tool to answer.",
                         tools=[get_weather], model=model, reset_tool_choice=True,
                         model_settings=agents.ModelSettings(
                             tool_choice="required", temperature=0, max_tokens=300,
                             parallel_tool_calls=False))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert asked and len(asked) == 1 and asked[0]
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str) and result.final_output
