"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat
completions path.

A body becomes the chat completions body that says the same thing, checked by
openai_api.parse: `system` (a string or text blocks) a system message; each message's text
blocks its content, an assistant's `tool_use` blocks its tool_calls (the block's id the call's
id), a user's `tool_result` blocks tool messages before the rest of its text; `thinking` blocks
of earlier turns are dropped (templates drop earlier thinking too); images and documents are a
400. `tools` ({"name", "description", "input_schema"}) become function tools, `tool_choice`
auto / any / tool / none becomes "auto" / "required" / the named function / "none"
(`disable_parallel_tool_use`: parallel_tool_calls false), `stop_sequences` stop, `max_tokens`
(required) max_tokens, `thinking` {"type": "enabled" | "disabled"} the template's
enable_thinking, `output_config` (structured outputs) `format` response_format and `effort` the
template's reasoning_effort. Sampling: temperature, top_p, top_k (and pyklei's other sampling
fields) as chat completions takes them; the anthropic client sends them in extra_body.

The reply is content blocks built from replies.pieces: `thinking` (a thinking model's
thinking), `text`, `tool_use` (input: the call's arguments as an object); stop_reason end_turn,
max_tokens, stop_sequence (with the stop_sequence that matched) or tool_use. Streamed:
message_start, ping, per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage)
and message_stop; a failure mid-stream is an `error` event. A reply cut by the server's drain
deadline has stop_reason "cancelled", as chat completions' finish_reason says. usage: input_tokens (the prompt's
tokens that ran), cache_read_input_tokens (those the prefix cache held), output_tokens.

Errors have Anthropic's shape: {"type": "error", "error": {"type", "message"}}, the type by the
HTTP status (ERROR_TYPES).
"""
from __future__ import annotations

import json
import uuid

from . import openai_api as api
from .replies import Piece, positive_int, sampling_fields, stop_sequence
from .sse import named_event as sse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
# server-side features of Anthropic's API this server does not run
UNSUPPORTED = ("mcp_servers", "container", "context_management")
FIELD_NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking",
               "response_format": "output_config.format"}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def error_body(e: api.APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "invalid_request_error"),
                                       "message": str(e)}}


# ---- the request ----------------------------------------------------------------------------

def _texts(blocks, where: str) -> str:
    """Text blocks (or a string) as one text."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise api.APIError(f"{where} must be a string or a list of text blocks", where)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise api.APIError(f"{where}[{j}]: only text blocks ({{\"type\": \"text\", \"text\": "
                               f"...}}) are supported here, got {kind!r}", where)
        out.append(b["text"])
    return "".join(out)


def _message(i: int, m) -> list[dict]:
    """One Messages message as chat messages."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise api.APIError(f"{where} must be {{\"role\": \"user\" | \"assistant\", \"content\": "
                           f"...}}", where)
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise api.APIError(f"{where}.content must be a string or a list of content blocks",
                           f"{where}.content")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                    and isinstance(b.get("input"), dict)):
                raise api.APIError(f"{at}: a tool_use block needs 'id', 'name' and 'input' (an "
                                   f"object)", at)
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise api.APIError(f"{at}.tool_use_id must be the id of the tool_use it answers",
                                   at)
            result = _texts(b.get("content", ""), f"{at}.content")
            if b.get("is_error") is True:
                result = "Error: " + result
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise api.APIError(f"{at}: a {kind!r} block is not supported in a {role} message "
                               f"(text, tool_use in assistant messages, tool_result in user "
                               f"messages)", at)
    if role == "assistant":
        msg = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def chat_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise api.APIError("'tools' must be a list of {\"name\", \"description\", "
                           "\"input_schema\"}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise api.APIError(f"tools[{i}]: only client tools with an input_schema are "
                               f"supported (no server tools), got type {kind!r}", f"tools[{i}]")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise api.APIError(f"tools[{i}].input_schema must be a JSON schema object",
                               f"tools[{i}].input_schema")
        f = {"name": t.get("name"), "parameters": schema}
        if t.get("description") is not None:
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice) -> tuple[object, bool]:
    """(chat completions' tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise api.APIError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | "
                           "\"none\"}", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise api.APIError("tool_choice.disable_parallel_tool_use must be true or false",
                           "tool_choice")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise api.APIError("tool_choice {\"type\": \"tool\"} needs the tool's 'name'",
                               "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, not parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not parallel


def chat_body(body: dict, count_only: bool = False) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise api.APIError("'messages' must be a non-empty list", "messages")
    system = body.get("system")
    out_msgs = ([{"role": "system", "content": _texts(system, "system")}]
                if system not in (None, "", []) else [])
    for i, m in enumerate(messages):
        out_msgs += _message(i, m)
    out = sampling_fields(body)
    out["messages"] = out_msgs
    if not count_only:
        out["max_tokens"] = positive_int(body, "max_tokens", required=True)
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list):
                raise api.APIError("'stop_sequences' must be a list of strings", "stop_sequences")
            out["stop"] = stops
    if body.get("tools") is not None:
        out["tools"] = chat_tools(body["tools"])
    choice, parallel = chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        out["tool_choice"] = choice
        out["parallel_tool_calls"] = parallel
    out.update(output_config(body.get("output_config")))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise api.APIError("'thinking' must be {\"type\": \"enabled\" | \"disabled\"}",
                               "thinking")
        out.setdefault("chat_template_kwargs", {})["enable_thinking"] = kind != "disabled"
    return out


def output_config(config) -> dict:
    """Structured outputs' `output_config`: `format` {"type": "json_schema", "schema"} as
    response_format, `effort` as the template's reasoning_effort."""
    if config is None:
        return {}
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not (fmt is None or isinstance(fmt, dict) and fmt.get(
            "type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise api.APIError("'output_config' must be {\"format\": {\"type\": \"json_schema\", "
                           "\"schema\": {...}}, \"effort\": ...}", "output_config")
    out = {}
    if fmt is not None:
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["chat_template_kwargs"] = {"reasoning_effort": config["effort"]}
    return out


def _renamed(e: api.APIError) -> api.APIError:
    head = (e.param or "").split("[", 1)[0].split(".", 1)[0]
    name = FIELD_NAMES.get(head)
    if name is None:
        return e
    return api.APIError(str(e).replace(f"'{head}'", f"'{name}'"), name, e.status, e.type, e.code)


def _check(body) -> None:
    if not isinstance(body, dict):
        raise api.APIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise api.APIError("'model' must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise api.APIError("'stream' must be true or false", "stream")
    for name in UNSUPPORTED:       # a 200 must never have ignored what the client asked for
        if body.get(name) not in (None, [], {}):
            raise api.APIError(f"'{name}' is not supported by this server; leave it out", name)


def parse(body, tokenizer, n_ctx: int, special_in_content: bool = False) -> api.Request:
    _check(body)
    try:
        req = api.parse("chat", chat_body(body), tokenizer, n_ctx, special_in_content)
    except api.APIError as e:
        raise _renamed(e) from None
    req.stream = bool(body.get("stream"))
    return req


def count_tokens(body, tokenizer, n_ctx: int, special_in_content: bool = False) -> dict:
    """{"input_tokens": the prompt's token count}, the prompt rendered as parse renders it."""
    _check(body)
    try:
        chat = chat_body(body, count_only=True)
        tools = api.tools_from(chat)[0]
        ids = api.prompt_ids("chat", chat, tokenizer, n_ctx, tools, special_in_content)
    except api.APIError as e:
        raise _renamed(e) from None
    return {"input_tokens": len(ids)}


# ---- the response ---------------------------------------------------------------------------

class MessageBuilder:
    """Content blocks from replies' Pieces, and the streamed events that build them."""

    def __init__(self, req, model: str, tokenizer):
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.rid = _id("msg_")
        self.blocks: list[dict] = []
        self.open: dict | None = None         # the text or thinking block being written
        self.start = self.end = None
        self.text = ""                        # every text piece (stop_sequence reads its end)
        self.has_calls = False

    def message(self, content: list, stop_reason=None, stop_seq=None, usage=None) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_seq,
                "usage": usage or self.usage()}

    def usage(self) -> dict:
        start, end = self.start, self.end or self.start
        ran = start.prompt_eval_tokens
        return {"input_tokens": ran, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": start.prompt_tokens - ran,
                "output_tokens": end.generation_tokens if self.end else 0}

    def feed(self, p: Piece) -> list[dict]:
        if p.kind == "start":
            self.start = p.last
            return [{"type": "message_start", "message": self.message([])}, {"type": "ping"}]
        if p.kind == "reasoning":
            return self._write("thinking", p.text)
        if p.kind == "text":
            self.text += p.text
            return self._write("text", p.text)
        if p.kind == "calls":
            events = self._close()
            for c in p.calls:
                events += self._tool_use(c)
            return events
        self.end = p.last                        # "end"
        reason, seq = self.stop()
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
             "usage": self.usage()},
            {"type": "message_stop"}]

    def stop(self) -> tuple[str, str | None]:
        if self.has_calls:
            return "tool_use", None
        if self.end.finish_reason == "length":
            return "max_tokens", None
        if self.end.finish_reason == "cancelled":    # the server's drain deadline cut it
            return "cancelled", None
        seq = stop_sequence(self.end, self.req.stop, self.tokenizer,
                            self.req.constraint is not None, self.text)
        return ("stop_sequence", seq) if seq is not None else ("end_turn", None)

    def whole(self) -> dict:
        reason, seq = self.stop()
        return self.message(self.blocks, reason, seq)

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = ({"type": "text", "text": ""} if kind == "text"
                         else {"type": "thinking", "thinking": "", "signature": ""})
            events.append({"type": "content_block_start", "index": len(self.blocks),
                           "content_block": dict(self.open)})
        self.open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {
            "type": "thinking_delta", "thinking": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks),
                          "delta": delta}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.blocks.append(self.open)
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _tool_use(self, call: dict) -> list[dict]:
        f = call["function"]
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):     # Anthropic's input is an object: else it is text
            return self._write("text", f"{f['name']}({f['arguments']})") + self._close()
        self.has_calls = True
        cid = "toolu_" + call["id"].removeprefix("call_")
        block = {"type": "tool_use", "id": cid, "name": f["name"], "input": args}
        i = len(self.blocks)
        self.blocks.append(block)
        partial = json.dumps(args, ensure_ascii=False)    # whole: one delta is valid JSON
        return [{"type": "content_block_start", "index": i,
                 "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": i,
                 "delta": {"type": "input_json_delta", "partial_json": partial}},
                {"type": "content_block_stop", "index": i}]


class Front:
    """The Messages API as app._serve_api drives it."""
    name = "messages"

    @staticmethod
    def parse(s, body, tenant):
        return parse(body, s.tokenizer, s.n_ctx, s.special_in_content), None

    @staticmethod
    def error_body(e: api.APIError) -> dict:
        return error_body(e)

    @staticmethod
    async def stream(s, req, turn, pieces):
        b = MessageBuilder(req, s.model_id, s.tokenizer)
        try:
            async for p in pieces:
                for e in b.feed(p):
                    yield sse(e)
        except Exception as e:           # this request failed: the stream says so, and ends
            yield sse(error_body(api.APIError(f"{type(e).__name__}: {e}", status=500)))

    @staticmethod
    async def whole(s, req, turn, pieces) -> dict:
        b = MessageBuilder(req, s.model_id, s.tokenizer)
        async for p in pieces:
            b.feed(p)
        return b.whole()
