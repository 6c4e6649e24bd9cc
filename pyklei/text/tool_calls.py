"""Tool calling: a conversation with tools rendered for the model, and its reply parsed into
OpenAI's `tool_calls`.

    prompt = render(tokenizer, messages, tools)          # token ids
    parser = reply_parser(tools, tokenizer.chat_template, messages, tool_choice)
    content, calls = parser.parse(text)                   # calls: [{"id", "type", "function"}]

Rendering. A chat template that knows tools (its source uses `tools`, as Llama 3.1+ and Qwen's
do) gets them, and the conversation's tool calls and results, in the Hugging Face shape it
expects (`tool_calls[].function.arguments` as an object). A template that does not (ChatML,
SmolLM2) would drop them silently, so pyklei describes the tools in a system message and asks
for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention,
which Qwen's and SmolLM3's templates use too); the calls and results of earlier turns are
written the same way, results inside `<tool_response>` in a user message. Message content is
tokenized as text (Tokenizer.apply_chat_template): a tool result cannot open a turn.

Parsing (`CallParser`): a reply is a call only in the call format of the model's family and
only for a declared tool; everything else is content, its text intact.
* The format: `<tool_call>` blocks for pyklei's fallback and for templates that write the tag
  (the last block may lack its closing tag when max_tokens cut it); a bare JSON object, or a
  list of them, with `name` and `parameters` or `arguments` for the other templates that know
  tools (Llama 3.x's JSON tool calls). Bare JSON under a tagged template is content, and tags
  under a JSON template are content.
* The name: one of the tools offered; a block or object naming another is content.
* Echoes: a call whose JSON text appears verbatim in the request's own user or tool message
  content is content. Untrusted text (a web page in a tool result, a user's paste) that the
  model repeats never becomes a call; the cost is that a call the user typed out exactly is not
  run either. Forced calls (tool_choice "required" or a named function) are exempt: the client
  asked for a call and the grammar wrote it.
* A reply under the client's own constraint (response_format, json_schema, grammar) is content,
  as OpenAI's response_format shapes the content: `reply_parser` gives no parser then.
A stream holds back only what may still become such a call (`CallParser.split_stream`).

`call_schema()` is the JSON schema of one call of the given tools (or of one named tool): the
constraint for `tool_choice` "required" or a named function (pyklei.runtime.grammar, when it is
installed), so the reply is a valid call whatever the model's size.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
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


def render(tokenizer, messages: Sequence[dict], tools: list[dict] | None,
           parse_special_in_content: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids: the chat template, with the tools (module doc).
    parse_special_in_content: as Tokenizer.apply_chat_template's (off: content is text);
    template_kwargs: more template variables (checked: chat_template.check_template_kwargs)."""
    native = knows_tools(tokenizer.chat_template)
    msgs = template_messages(messages, native)
    if tools and not native:
        described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        note = _FALLBACK_SYSTEM.format(tools=described)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    kw = {**(template_kwargs or {}), **({"tools": tools} if tools and native else {})}
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                         parse_special_in_content=parse_special_in_content, **kw)


def calls_are_tagged(template: str | None) -> bool:
    """Whether the model writes its calls as <tool_call> blocks (pyklei's fallback, and
    templates that use the tags) rather than as bare JSON (Llama 3.x)."""
    return not knows_tools(template) or TAG_OPEN in (template or "")


QUOTING_ROLES = ("user", "tool")   # whose message content a call must not merely repeat


def reply_parser(tools: Sequence[dict], template: str | None, messages: Sequence[dict] = (),
                 tool_choice="auto", constrained: bool = False) -> "CallParser | None":
    """The parser of a reply to `messages` with `tools` offered, or None when the reply is
    content whatever it says: no tools, or `constrained`, the client's own constraint
    (response_format, json_schema, grammar, regex; not a forced call's grammar) shapes it.
    Forced calls (tool_choice "required" or a named function) are not checked for echoes
    (module doc)."""
    if not tools or constrained:
        return None
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    quoted = () if forced else tuple(
        m["content"] for m in messages if isinstance(m, dict) and m.get("role") in QUOTING_ROLES
        and isinstance(m.get("content"), str) and m["content"])
    return CallParser(frozenset(t["function"]["name"] for t in tools), calls_are_tagged(template),
                      quoted)


def parse_reply(text: str, tools: Sequence[dict], template: str | None = None,
                messages: Sequence[dict] = ()) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply to `messages`: reply_parser(...).parse(text)."""
    parser = reply_parser(tools, template, messages)
    return (text, []) if parser is None else parser.parse(text)


_BLOCK = re.compile(re.escape(TAG_OPEN) + r"(.*?)(" + re.escape(TAG_CLOSE) + r"|$)", re.S)
# What the text of a JSON call (or list of calls) may begin with: whitespace, "[", "{" and '"'.
_JSON_CALL_START = re.compile(r'\s*(\[\s*)?(\{\s*("|\Z)|\Z)')


@dataclass(frozen=True)
class CallParser:
    """Reads tool calls out of a model's reply (module doc: the format, the names, echoes)."""

    names: frozenset[str]            # the tools offered: a call names one of them
    tagged: bool                     # <tool_call> blocks; else a bare JSON object or list
    quoted: tuple[str, ...] = ()     # user and tool message texts a call must not repeat

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole reply. Without calls the content is the reply's
        text, intact; with calls it is the text outside them, stripped (None when empty).
        Calls have OpenAI's shape, arguments a JSON string."""
        if not self.tagged:
            calls = self._json_calls(text)
            return (None, calls) if calls else (text, [])
        calls, rest, pos = [], [], 0
        for m in _BLOCK.finditer(text):
            call = self._block_call(m.group(1))
            if call is None:
                if not m.group(2) and calls:   # a call cut by max_tokens after whole ones
                    rest.append(text[pos:m.start()])
                    pos = len(text)
                continue
            calls.append(call)
            rest.append(text[pos:m.start()])
            pos = m.end()
        if not calls:
            return text, []
        rest.append(text[pos:])
        return ("".join(rest).strip() or None), calls

    def split_stream(self, held: str) -> tuple[str, str | None]:
        """A stream's held-back text split into (content to send now, text to keep holding,
        None when nothing that follows can be a call). The text kept is what may still become
        a call: an unfinished or finished call block with what follows it, a tail that may
        begin a tag, or a reply that may still be a JSON call. parse() of the whole reply
        decides at the end; what was sent is content under its rules too."""
        if not self.tagged:
            if not _JSON_CALL_START.match(held):
                return held, None                # not the start of a JSON call: content
            if not held.rstrip().endswith(("}", "]")):
                return "", held                  # may still close into a call
            try:
                json.loads(held)
            except ValueError:
                return "", held
            return ("", held) if self._json_calls(held) else (held, None)
        pos = 0
        while True:
            start = held.find(TAG_OPEN, pos)
            if start < 0:
                tail = next((k for k in range(min(len(TAG_OPEN) - 1, len(held) - pos), 0, -1)
                             if TAG_OPEN.startswith(held[len(held) - k:])), 0)
                cut = len(held) - tail
                return held[:cut], held[cut:]
            end = held.find(TAG_CLOSE, start)
            if end < 0 or self._block_call(held[start + len(TAG_OPEN):end]) is not None:
                return held[:start], held[start:]
            pos = end + len(TAG_CLOSE)           # a block that is no call: content

    def _call(self, obj, need_arguments: bool) -> dict | None:
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        if need_arguments and "arguments" not in obj and "parameters" not in obj:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": obj["name"],
                             "arguments": args if isinstance(args, str) else json.dumps(args)}}

    def _echoed(self, call_text: str) -> bool:
        return any(call_text in q for q in self.quoted)

    def _block_call(self, inner: str) -> dict | None:
        """The call a <tool_call> block holds, or None: not JSON, an undeclared name, or an
        echo of a user or tool message."""
        inner = inner.strip()
        if not inner or self._echoed(inner):
            return None
        try:
            return self._call(json.loads(inner), need_arguments=False)
        except ValueError:
            return None

    def _json_calls(self, text: str) -> list[dict]:
        """The calls of a reply that is a bare JSON call or list of calls (each with "name"
        and "parameters" or "arguments"), else []."""
        items = _json_items(text)
        if not items:
            return []
        calls = [None if self._echoed(raw) else self._call(obj, need_arguments=True)
                 for obj, raw in items]
        return calls if all(calls) else []


def _json_items(text: str) -> list[tuple[Any, str]]:
    """A JSON object, or a list of them, as [(value, its exact text)]; [] when `text` is
    not one (surrounding whitespace aside)."""
    decoder, s = json.JSONDecoder(), text.strip()
    ws = re.compile(r"\s*")
    try:
        if s.startswith("{"):
            obj, end = decoder.raw_decode(s)
            return [(obj, s)] if end == len(s) else []
        if not s.startswith("["):
            return []
        items, pos = [], ws.match(s, 1).end()
        while True:
            obj, end = decoder.raw_decode(s, pos)
            items.append((obj, s[pos:end]))
            pos = ws.match(s, end).end()
            if s[pos:pos + 1] == ",":
                pos = ws.match(s, pos + 1).end()
                continue
            return items if s[pos:] == "]" else []
    except ValueError:
        return []


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
    if calls_are_tagged(template):
        block = f'"{TAG_OPEN}" call "{TAG_CLOSE}"'
        start = f'{block} ("\\n" {block})*' if parallel else block
        return f"start: {start}\ncall: %json {json.dumps(call_schema(tools, name))}"
    schema = call_schema(tools, name, parallel, key="parameters")
    return f"start: call\ncall: %json {json.dumps(schema)}"
