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

The formats (CallFormat; call_format(template) picks one from TEMPLATE_FORMATS, the one table):
* Hermes (HERMES): `<tool_call>{"name", "arguments"}</tool_call>` blocks among content; pyklei's
  fallback, Qwen2.5/Qwen3, SmolLM3 and every template that writes the tag.
* Mistral before tokenizer v11 (MISTRAL_LIST): content, then `[TOOL_CALLS] [{"name",
  "arguments"}, ...]`; from v11 (MISTRAL): `[TOOL_CALLS]name[ARGS]{...}` per call.
* Llama 3.x (LLAMA3_JSON): the whole reply is `{"name", "parameters"}` (or "arguments"),
  perhaps after <|python_tag|>; a list, or objects separated by ';', are read too.
The template decides, not the architecture: it is what taught the model its format.

Parsing (`CallParser`): a reply is a call only in the call format of the model's template and
only for a declared tool; everything else is content, its text intact.
* The format: a call cut by max_tokens after whole ones is dropped (a Hermes block whose JSON
  is whole but its closing tag cut is kept); markup of another format is content.
* The name: one of the tools offered; a call naming another is content. Arguments: a JSON
  object.
* Echoes: a call whose text appears verbatim in the request's own user or tool message
  content is content. Untrusted text (a web page in a tool result, a user's paste) that the
  model repeats never becomes a call; the cost is that a call the user typed out exactly is not
  run either. Forced calls (tool_choice "required" or a named function) are exempt: the client
  asked for a call and the grammar wrote it.
* Repeats: a call identical to an earlier one of the reply (same name, same arguments) is left
  out: an agent would run its side effect twice.
* A reply under the client's own constraint (response_format, json_schema, grammar) is content,
  as OpenAI's response_format shapes the content: `reply_parser` gives no parser then.
A stream holds back only what may still become such a call (`CallParser.split_stream`), so a
streamed call comes whole and no piece of its markup is sent as content.

Forced calls (`forced_calls`): tool_choice "required" or a named function constrains the reply
to calls in the model's own format (pyklei.runtime.grammar.constraint(tool_calls=...)), so the
reply is valid calls whatever the model's size: each tool's parameters closed at every object
level and its `$defs` carried to the root of the call's schema (`call_schema`), closed within
max_tokens as any JSON schema is, and ended at a call that repeats an earlier one.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from .json_schema import close_objects, hoist_defs

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


# ---- the call formats ------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"                           # Llama 3.x: before a JSON call, at times
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"  # Mistral's control tokens


_WS = re.compile(r"\s*")


def _read_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` (after whitespace) and where it ends, or None."""
    pos = _WS.match(text, pos).end()
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        return None


class CallFormat:
    """How one family of models writes tool calls: parse() reads a whole reply, split_stream()
    tells a stream's content from what may still be a call, lark() is the grammar of forced
    calls. `read(obj, raw)` gives the call an object stands for (CallParser: a declared name,
    not an echo), or None."""
    name = ""

    def parse(self, text, read) -> tuple[str | None, list[dict]]:
        raise NotImplementedError

    def split_stream(self, held: str, read) -> tuple[str, str | None]:
        raise NotImplementedError

    def lark(self, one: dict, lit, json_rule, parallel: bool) -> str:
        """one: {tool name: its closed parameters}; lit(text): the Lark terminal of a marker
        (its special token when it is one); json_rule(schema): `%json {...}`."""
        raise NotImplementedError

    @staticmethod
    def _hold_marker(held: str, marker: str) -> tuple[str, str]:
        """Everything from the marker on is held; without it, a tail that may begin it."""
        start = held.find(marker)
        if start >= 0:
            return held[:start], held[start:]
        tail = next((k for k in range(min(len(marker) - 1, len(held)), 0, -1)
                     if marker.startswith(held[len(held) - k:])), 0)
        return held[:len(held) - tail], held[len(held) - tail:]


class HermesCalls(CallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content (Hermes,
    Qwen2.5/Qwen3, SmolLM3, and pyklei's fallback prompt); the last block may lack its closing
    tag when max_tokens cut it."""
    name = "hermes"
    _BLOCK = re.compile(re.escape(TAG_OPEN) + r"(.*?)(" + re.escape(TAG_CLOSE) + r"|$)", re.S)

    def _block(self, inner: str, read):
        inner = inner.strip()
        got = _read_json(inner, 0) if inner else None
        return read(got[0], inner) if got and got[1] == len(inner) else None

    def parse(self, text, read):
        calls, rest, pos = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._block(m.group(1), read)
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

    def split_stream(self, held, read):
        pos = 0
        while True:
            start = held.find(TAG_OPEN, pos)
            if start < 0:
                send, keep = self._hold_marker(held[pos:], TAG_OPEN)
                return held[:pos] + send, keep
            end = held.find(TAG_CLOSE, start)
            if end < 0 or self._block(held[start + len(TAG_OPEN):end], read) is not None:
                return held[:start], held[start:]
            pos = end + len(TAG_CLOSE)           # a block that is no call: content

    def lark(self, one, lit, json_rule, parallel):
        block = f'{lit(TAG_OPEN)} "\\n"? call "\\n"? {lit(TAG_CLOSE)}'   # Qwen's newlines
        start = f'{block} ("\\n" {block})*' if parallel else block
        return f"start: {start}\ncall: {json_rule(_call_object(one, 'arguments'))}"


class JsonCalls(CallFormat):
    """Llama 3.x: the whole reply is a JSON call `{"name": ..., "parameters": {...}}` (or
    "arguments"), perhaps after <|python_tag|>; several as a JSON list or separated by ';'
    are read too. Llama's templates take one call per message (they raise on more), so forced
    calls are one."""
    name = "llama3_json"
    _START = re.compile(r"\s*(" + re.escape(PYTHON_TAG) + r"\s*)?(\[\s*)?(\{\s*(\"|\Z)|\Z)")

    def _calls(self, text, read) -> list[dict]:
        s = text.strip()
        s = s[len(PYTHON_TAG):] if s.startswith(PYTHON_TAG) else s
        items = _json_items(s, separators=(",", ";"))
        if not items:
            return []
        calls = [read(obj, raw) if isinstance(obj, dict) and ("parameters" in obj
                                                              or "arguments" in obj) else None
                 for obj, raw in items]
        return calls if all(calls) else []

    def parse(self, text, read):
        calls = self._calls(text, read)
        return (None, calls) if calls else (text, [])

    def split_stream(self, held, read):
        if not self._START.match(held):
            return held, None                    # not the start of a JSON call: content
        s = held.strip()
        s = s[len(PYTHON_TAG):] if s.startswith(PYTHON_TAG) else s
        if not s.endswith(("}", "]")) or not _json_items(s, separators=(",", ";")):
            return "", held                      # may still close into a call
        return ("", held) if self._calls(held, read) else (held, None)

    def lark(self, one, lit, json_rule, parallel):
        return f"start: call\ncall: {json_rule(_call_object(one, 'parameters'))}"


class MistralListCalls(CallFormat):
    """Mistral before tokenizer v11 (Mistral 7B v0.3, Mistral Small 3.1's template):
    content, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; a list cut after
    whole calls (max_tokens, or a repeated call ended) keeps those."""
    name = "mistral_list"

    def parse(self, text, read):
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text, []
        items = _json_items(text[start + len(MISTRAL_CALLS):].strip(), unclosed=True)
        calls = [read(obj, raw) for obj, raw in items]
        if not calls or not all(calls):
            return text, []
        return text[:start].strip() or None, calls

    def split_stream(self, held, read):
        return self._hold_marker(held, MISTRAL_CALLS)

    def lark(self, one, lit, json_rule, parallel):
        more = ' ("," " "? call)*' if parallel else ""
        return (f'start: {lit(MISTRAL_CALLS)} " "? "[" call{more} "]"\n'
                f"call: {json_rule(_call_object(one, 'arguments'))}")


class MistralCalls(CallFormat):
    """Mistral from tokenizer v11 (Ministral 3, Magistral, Devstral, Mistral Small 3.2):
    content, then per call `[TOOL_CALLS]name[ARGS]{...}` (v11 may add `[CALL_ID]id` before
    [ARGS]); a call cut by max_tokens after whole ones is dropped."""
    name = "mistral"
    _HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?"
                       + re.escape(MISTRAL_ARGS))

    def parse(self, text, read):
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text, []
        calls = []
        parts = text[start + len(MISTRAL_CALLS):].split(MISTRAL_CALLS)
        for k, part in enumerate(parts):
            head = self._HEAD.match(part)
            got = _read_json(part, head.end()) if head else None
            call = None
            if got and not part[got[1]:].strip():
                call = read({"name": head.group(1), "arguments": got[0]}, part.strip())
            if call is None:
                if k == len(parts) - 1 and calls and got is None:   # cut by max_tokens
                    break
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def split_stream(self, held, read):
        return self._hold_marker(held, MISTRAL_CALLS)

    def lark(self, one, lit, json_rule, parallel):
        rules = " | ".join(f'"{n}" {lit(MISTRAL_ARGS)} args{i}' for i, n in enumerate(one))
        start = "call+" if parallel else "call"
        return "\n".join([f"start: {start}", f"call: {lit(MISTRAL_CALLS)} ({rules})"]
                         + [f"args{i}: {json_rule(p)}" for i, p in enumerate(one.values())])


HERMES, LLAMA3_JSON = HermesCalls(), JsonCalls()
MISTRAL_LIST, MISTRAL = MistralListCalls(), MistralCalls()
# The one table: which format a chat template teaches, by what its source writes, first match
# first. The template decides, not the architecture: a Llama fine-tune with ChatML's template
# gets pyklei's fallback prompt (Hermes blocks), Qwen2.5 and Hermes-3-Llama both write Hermes
# blocks, and each Mistral generation's template says which of its two formats it writes.
TEMPLATE_FORMATS = ((MISTRAL_ARGS, MISTRAL), (MISTRAL_CALLS, MISTRAL_LIST), (TAG_OPEN, HERMES))


def call_format(template: str | None) -> CallFormat:
    """The format a model with this chat template writes its calls in: pyklei's fallback
    (Hermes) for a template that does not know tools, else TEMPLATE_FORMATS' first match,
    else Llama 3.x's JSON (a template that knows tools and names no markup)."""
    if not knows_tools(template):
        return HERMES
    return next((fmt for marker, fmt in TEMPLATE_FORMATS if marker in template), LLAMA3_JSON)


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
    return CallParser(frozenset(t["function"]["name"] for t in tools), call_format(template),
                      quoted)


def parse_reply(text: str, tools: Sequence[dict], template: str | None = None,
                messages: Sequence[dict] = ()) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply to `messages`: reply_parser(...).parse(text)."""
    parser = reply_parser(tools, template, messages)
    return (text, []) if parser is None else parser.parse(text)


@dataclass(frozen=True)
class CallParser:
    """Reads tool calls out of a model's reply (module doc: the format, the names, echoes,
    repeats)."""

    names: frozenset[str]            # the tools offered: a call names one of them
    fmt: CallFormat = HERMES         # the model's call format (call_format)
    quoted: tuple[str, ...] = ()     # user and tool message texts a call must not repeat

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole reply. Without calls the content is the reply's
        text, intact; with calls it is the text outside them, stripped (None when empty).
        Calls have OpenAI's shape, arguments a JSON string; a call identical to an earlier one
        (same name, same arguments) is left out."""
        content, calls = self.fmt.parse(text, self._read)
        seen, unique = set(), []
        for c in calls:
            key = _call_key(c)
            if key not in seen:
                seen.add(key)
                unique.append(c)
        return content, unique

    def split_stream(self, held: str) -> tuple[str, str | None]:
        """A stream's held-back text split into (content to send now, text to keep holding,
        None when nothing that follows can be a call). The text kept is what may still become
        a call: an unfinished or finished call with what follows it, a tail that may begin
        the format's markup, or a reply that may still be a JSON call. parse() of the whole
        reply decides at the end; what was sent is content under its rules too."""
        return self.fmt.split_stream(held, self._read)

    def repeats_a_call(self, text: str) -> bool:
        """Whether `text` holds two identical calls (ForcedCalls ends a reply there)."""
        if not text.rstrip().endswith(("}", "]", ">")):
            return False
        calls = self.fmt.parse(text, self._read)[1]
        return len({_call_key(c) for c in calls}) < len(calls)

    def _read(self, obj, raw: str) -> dict | None:
        """The call `obj` (its text `raw`) stands for: a declared name, arguments an object
        (or absent: {}), and not an echo of a user or tool message; else None."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        if any(raw in q for q in self.quoted):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def _call_key(call: dict) -> tuple[str, str]:
    f = call["function"]
    return f["name"], json.dumps(json.loads(f["arguments"]), sort_keys=True)


def _json_items(s: str, separators=(",",), unclosed: bool = False) -> list[tuple[Any, str]]:
    """A JSON object, a list of them, or (with ';' among `separators`) objects separated by
    ';', as [(value, its exact text)]; [] when `s` (stripped) is none of these. unclosed: a
    list may end after a whole item without its ']' (a reply cut there)."""
    s = s.strip()
    if s.startswith("{"):
        items, pos = [], 0
        while True:
            got = _read_json(s, pos)
            if got is None:
                return []
            items.append((got[0], s[pos:got[1]].strip()))
            pos = _WS.match(s, got[1]).end()
            if pos == len(s):
                return items
            if s[pos] != ";" or ";" not in separators:
                return []
            pos += 1
    if not s.startswith("["):
        return []
    items, pos = [], 1
    while True:
        got = _read_json(s, pos)
        if got is None:
            return []
        items.append((got[0], s[_WS.match(s, pos).end():got[1]]))
        pos = _WS.match(s, got[1]).end()
        if s[pos:pos + 1] == ",":
            pos += 1
            continue
        return items if s[pos:] == "]" or (unclosed and pos == len(s)) else []


# ---- forced calls ----------------------------------------------------------------------------

def call_schema(tools: list[dict], name: str | None = None, key: str = "arguments") -> dict:
    """The JSON schema of one call of `tools` (or of the one named): {"name": const, key: its
    parameters}, every object level closed (json_schema.close_objects: OpenAI's strict mode)
    and each tool's "$defs" carried to the root, its refs rewritten (json_schema.hoist_defs)."""
    return _call_object(_closed_parameters(tools, name), key)


def _closed_parameters(tools, name) -> dict:
    """{tool name: its parameters, closed, $defs and refs left where they are}."""
    return {t["function"]["name"]: close_objects(t["function"].get("parameters")
                                                 or {"type": "object"})
            for t in tools if name is None or t["function"]["name"] == name}


def _call_object(one: dict, key: str) -> dict:
    defs, calls = {}, []
    for name, params in one.items():
        body, own = hoist_defs(params, name + ".")
        defs.update(own)
        calls.append({"type": "object", "properties": {"name": {"const": name}, key: body},
                      "required": ["name", key], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "$defs": defs} if defs else schema


@dataclass(frozen=True)
class ForcedCalls:
    """The calls tool_choice "required" or a named function demands of a reply, in the model's
    own format (pyklei.runtime.grammar.constraint(tokenizer, tool_calls=...) compiles it).

    One call of the named function; with "required", one or more when parallel calls are
    allowed (Llama's JSON format: one), exactly one when not. A call identical to an earlier
    one of the reply ends the reply there (repeats_a_call), and the parser leaves it out: a
    grammar cannot forbid repeating a text it has not seen yet, and a small model that
    repeats a call once would go on repeating it."""
    tools: tuple
    name: str | None
    parallel: bool
    parser: CallParser

    def lark(self, tokenizer, json_options: dict) -> str:
        """The Lark grammar (llguidance's dialect); json_options: the JSON layout every %json
        follows (llguidance's "x-guidance")."""
        def lit(text):   # a marker that is one special token is matched as that token
            tid = tokenizer.token_to_id(text)
            return f"<[{tid}]>" if tid is not None and tid in tokenizer.special_ids else \
                json.dumps(text)

        def json_rule(schema):
            return "%json " + json.dumps({**schema, "x-guidance": json_options})
        return self.parser.fmt.lark(_closed_parameters(self.tools, self.name), lit, json_rule,
                                    self.parallel)

    def repeats_a_call(self, text: str) -> bool:
        return self.parser.repeats_a_call(text)


def forced_calls(tools: list[dict], choice, parallel: bool, template: str | None) -> ForcedCalls:
    """The ForcedCalls of choice "required" or {"type": "function", "function": {"name"}}."""
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    parser = CallParser(frozenset(t["function"]["name"] for t in tools), call_format(template))
    return ForcedCalls(tuple(tools), name, parallel and name is None, parser)
