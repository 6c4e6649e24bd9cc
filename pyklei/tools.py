"""Tool calling: a conversation with tools rendered for the model, and its reply parsed into
OpenAI's `tool_calls`.

    prompt = render(tokenizer, messages, tools)          # token ids
    content, calls = parse_reply(text)                    # calls: [{"id", "type", "function"}]

Rendering. A chat template that knows tools (its source uses `tools`, as Llama 3.1+ and Qwen's
do) gets them, and the conversation's tool calls and results, in the Hugging Face shape it
expects (`tool_calls[].function.arguments` as an object). A template that does not (ChatML,
SmolLM2) would drop them silently, so pyklei describes the tools in a system message and asks
for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention,
which Qwen's and SmolLM3's templates use too); the calls and results of earlier turns are
written the same way, results inside `<tool_response>` in a user message.

Parsing accepts the shapes models write: `<tool_call>` blocks (the last may lack its closing
tag when max_tokens cut it), or a reply that is a JSON object (or a list of them) with `name`
and `arguments` or `parameters` (Llama 3.x's JSON tool calls). Anything else is content.

`call_schema()` is the JSON schema of one call of the given tools (or of one named tool): the
constraint for `tool_choice` "required" or a named function (pyklei.grammar, when it is
installed), so the reply is a valid call whatever the model's size.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Sequence

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"

_FALLBACK_SYSTEM = (
    "You can call functions. Their JSON schemas:\n{tools}\n"
    "To call one, reply with only\n" + TAG_OPEN + '{{"name": "<function name>", '
    '"arguments": {{<arguments as JSON>}}}}' + TAG_CLOSE + "\n"
    "one block per call. Results come back in <tool_response> blocks. Otherwise answer in "
    "plain text.")


class ToolError(ValueError):
    """A malformed tool, tool choice or tool message; the message names the field."""


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?,
    "parameters"?}}], checked; names unique."""
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' "
                            f"or '-', got {name!r}")
        if name in names:
            raise ToolError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        if not isinstance(f.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        if not isinstance(f.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.description must be a string")
    return tools


def check_tool_choice(choice, tools: list[dict]) -> str | dict:
    """"none", "auto", "required", or {"type": "function", "function": {"name"}} naming one of
    `tools`. Absent: "auto" with tools, "none" without (OpenAI's defaults)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ToolError("'tool_choice': \"required\" needs 'tools'")
        return choice
    f = choice.get("function") if isinstance(choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"'tool_choice' names {name!r}, which is not one of the tools")
    return choice


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def _arguments(s) -> Any:
    """OpenAI sends arguments as a JSON string; templates want the object."""
    if isinstance(s, str):
        try:
            return json.loads(s)
        except ValueError:
            return s
    return s


def has_tool_turns(messages) -> bool:
    """Whether a conversation holds tool calls or tool results (it then needs render(), even
    when no tools are offered this turn)."""
    return any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
               for m in messages)


def template_messages(messages: Sequence[dict], native: bool) -> list[dict]:
    """The conversation as the template renders it. native: the Hugging Face tool shape;
    otherwise tool calls and results written as text (module doc)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            m = dict(m)
            if calls:
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"],
                    "arguments": _arguments(c["function"].get("arguments"))}} for c in calls]
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": "<tool_response>\n" + (m.get("content") or "")
                        + "\n</tool_response>"})
        elif calls:
            text = "".join(TAG_OPEN + json.dumps({"name": c["function"]["name"], "arguments":
                                                  _arguments(c["function"].get("arguments"))})
                           + TAG_CLOSE for c in calls)
            out.append({"role": m["role"], "content": (m.get("content") or "") + text})
        else:
            out.append(m)
    return out


def render(tokenizer, messages: Sequence[dict], tools: list[dict] | None) -> list[int]:
    """The prompt's token ids: the chat template, with the tools (module doc)."""
    native = knows_tools(tokenizer.chat_template)
    msgs = template_messages(messages, native)
    if tools and not native:
        described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        note = _FALLBACK_SYSTEM.format(tools=described)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    kw = {"tools": tools} if tools and native else {}
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)


def _call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_reply(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a reply. Content is the text outside the calls (None when
    there is none); calls have OpenAI's shape, arguments a JSON string."""
    calls, rest, pos = [], [], 0
    if TAG_OPEN in text:
        for m in re.finditer(re.escape(TAG_OPEN) + r"(.*?)(" + re.escape(TAG_CLOSE) + r"|$)",
                             text, re.S):
            try:
                call = _call(json.loads(m.group(1).strip()))
            except ValueError:
                call = None
            if call is None:
                if not m.group(2) and calls:   # a call cut by max_tokens after whole ones
                    rest.append(text[pos:m.start()])
                    pos = len(text)
                continue
            calls.append(call)
            rest.append(text[pos:m.start()])
            pos = m.end()
        rest.append(text[pos:])
    else:
        stripped = text.strip()
        if stripped[:1] in "{[":
            try:
                obj = json.loads(stripped)
            except ValueError:
                obj = None
            objs = obj if isinstance(obj, list) else [obj]
            found = [_call(o) for o in objs]
            if found and all(found):
                return None, found
        return text, []
    content = "".join(rest).strip()
    return (content or None), calls


def may_start_a_call(text: str) -> bool:
    """Whether a reply beginning with `text` may still turn out to be a tool call: a stream
    holds such text back until it knows."""
    t = text.lstrip()
    return not t or t[0] in "{[" or TAG_OPEN.startswith(t[:len(TAG_OPEN)])


def call_schema(tools: list[dict], name: str | None = None, parallel: bool = False,
                key: str = "arguments") -> dict:
    """The JSON schema of a call of one of `tools` (or of the one named): {"name": const,
    key: its parameters}; with parallel, a non-empty list of calls."""
    one = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        key: _closed(t["function"].get("parameters") or {"type": "object"})},
        "required": ["name", key], "additionalProperties": False}
        for t in tools if name is None or t["function"]["name"] == name]
    call = one[0] if len(one) == 1 else {"anyOf": one}
    return {"type": "array", "items": call, "minItems": 1} if parallel else call


def _closed(params: dict) -> dict:
    """A function's parameters without keys it does not declare, unless the schema says
    otherwise: a function takes its parameters (OpenAI's strict mode requires this too), and a
    small model left free to add keys can spend its whole budget inventing them."""
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def call_grammar(tools: list[dict], choice, parallel: bool, template: str | None) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are calls of `tools` as the model
    is asked to write them: <tool_call> blocks with "arguments" (pyklei's fallback, and templates
    that use the tags), else one JSON object with "parameters" (Llama 3.x), a list of them with
    parallel. choice: "required" or {"type": "function", "function": {"name"}}."""
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    parallel = parallel and name is None     # a named function: one call of it (OpenAI's)
    if not knows_tools(template) or TAG_OPEN in (template or ""):
        block = f'"{TAG_OPEN}" call "{TAG_CLOSE}"'
        start = f'{block} ("\\n" {block})*' if parallel else block
        return f"start: {start}\ncall: %json {json.dumps(call_schema(tools, name))}"
    schema = call_schema(tools, name, parallel, key="parameters")
    return f"start: call\ncall: %json {json.dumps(schema)}"
