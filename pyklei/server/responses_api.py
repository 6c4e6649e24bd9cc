"""OpenAI's Responses API (`POST /v1/responses`) on the chat completions path.

A body becomes the chat completions body that says the same thing, checked by
openai_api.parse (the same sampling rules, template, tool parser, grammar and budget):
`instructions` a system message first; `input` a string (one user message) or items: messages
(`input_text` / `output_text` parts), `function_call` items (an assistant's tool_calls, their
`call_id` the call's id) and `function_call_output` items (tool messages); `reasoning` items
are dropped, as the template would drop an earlier turn's thinking. Function tools come flat
(`{"type": "function", "name", "parameters"}`), `tool_choice` as "auto" / "none" / "required" /
`{"type": "function", "name"}`, `text.format` json_schema / json_object as response_format,
`max_output_tokens` as max_tokens (absent: the rest of the context, as OpenAI's limit is the
model's). Built-in tools (web search, files, ...), images and files are a 400 naming the field.

The reply is output items built from replies.pieces: a `reasoning` item (content
`reasoning_text`) for a thinking model's thinking, a `message` item (`output_text`), a
`function_call` item per call. Streamed, each item has its documented events
(response.output_item.added, content_part.added, output_text.delta / reasoning_text.delta /
function_call_arguments.delta, their .done events, output_item.done) between response.created
/ response.in_progress and response.completed (response.incomplete when max_output_tokens cut
it, response.failed when it failed), each with its sequence_number. The whole reply is the
same builder's items.

`store` (default true) keeps the conversation (input and output, not the instructions, which
OpenAI does not carry over either) in memory under the response's id, for `previous_response_id`
and GET /v1/responses/{id}: at most STORE_MAX responses, each for STORE_TTL_S seconds, and
visible only to the tenant (API key) that made it.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from . import openai_api as api
from .replies import Piece, positive_int, sampling_fields
from .sse import named_event as sse

STORE_MAX = 1024             # responses kept for previous_response_id
STORE_TTL_S = 3600.0         # seconds one is kept
# the chat completions field each Responses field becomes, for error messages that name it
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
               "response_format": "text.format", "chat_template_kwargs": "reasoning"}
# fields OpenAI has that this server does not implement: a 400 unless no-op (null or as shown)
UNSUPPORTED = {"background": (False,), "conversation": (), "prompt": (), "top_logprobs": (0,),
               "max_tool_calls": ()}
HOSTED_TOOLS = "only function tools are supported (no built-in tools)"


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponseStore:
    """Stored responses by (tenant, id), oldest first out: bounded in count and age."""

    def __init__(self, max_items: int = STORE_MAX, ttl_s: float = STORE_TTL_S):
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict = OrderedDict()     # (tenant, id) -> (time, messages, obj)
        self._lock = threading.Lock()

    def put(self, tenant, rid: str, messages: list, obj: dict) -> None:
        with self._lock:
            self._items[(tenant, rid)] = (time.monotonic(), messages, obj)
            self._expire()

    def get(self, tenant, rid: str):
        """(messages, response object), or None: unknown, expired or another tenant's."""
        with self._lock:
            self._expire()
            item = self._items.get((tenant, rid))
            return None if item is None else item[1:]

    def delete(self, tenant, rid: str) -> bool:
        with self._lock:
            return self._items.pop((tenant, rid), None) is not None

    def answer(self, tenant, rid: str, delete: bool = False) -> dict:
        """GET /v1/responses/{id}: the stored response; DELETE: OpenAI's deletion object; a 404
        unless the tenant stored it (and it is still kept)."""
        if delete and self.delete(tenant, rid):
            return {"id": rid, "object": "response", "deleted": True}
        found = None if delete else self.get(tenant, rid)
        if found is None:
            raise api.APIError(f"no stored response {rid!r}", "response_id", status=404,
                               code="not_found")
        return found[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            key, (t, _, _) = next(iter(self._items.items()))
            if len(self._items) <= self.max_items and now - t < self.ttl_s:
                break
            del self._items[key]


@dataclass
class Turn:
    """One Responses request beside its chat completions Request: what the response object
    echoes and what is stored."""
    rid: str
    body: dict                   # the request as given (its echoed fields)
    tools: list                  # the flat tools, as given
    conversation: list           # chat messages before this reply (no instructions)
    tenant: object = None
    store: bool = True
    created: int = field(default_factory=lambda: int(time.time()))


# ---- the request ----------------------------------------------------------------------------

def _text_of(content, where: str) -> str:
    """A message item's content: a string or input_text / output_text (refusal) parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise api.APIError(f"{where} must be a string or a list of input_text parts", where)
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(
                p.get(key), str):
            raise api.APIError(f"{where}[{j}]: only text parts ({{\"type\": \"input_text\", "
                               f"\"text\": ...}}) are supported, got {kind!r}", where)
        out.append(p[key])
    return "".join(out)


def input_messages(given) -> list[dict]:
    """`input` as chat messages (module doc)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise api.APIError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise api.APIError(f"{where} must be an object (a message, function_call or "
                               f"function_call_output item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise api.APIError(f"{where}.role must be user, assistant, system or developer, "
                                   f"got {role!r}", f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"),
                                                          f"{where}.content")})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(cid, str)):
                raise api.APIError(f"{where}: a function_call item needs 'call_id', 'name' and "
                                   f"'arguments' (JSON text) as strings", where)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":    # one turn, several parts
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, result = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise api.APIError(f"{where}.call_id must be the call_id of the call it answers",
                                   f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": _text_of(result, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise api.APIError(f"{where}.type {kind!r} is not supported (message, "
                               f"function_call, function_call_output, reasoning)", f"{where}.type")
    return out


def chat_tools(tools) -> list[dict]:
    """Responses' flat function tools in chat completions' nested shape."""
    if not isinstance(tools, list):
        raise api.APIError("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise api.APIError(f"tools[{i}].type {kind!r}: {HOSTED_TOOLS}", f"tools[{i}].type")
        f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice       # "auto", "none", "required" (anything else: openai_api says so)
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise api.APIError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def response_format(text) -> dict | None:
    """`text.format` as chat completions' response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise api.APIError("'text' must be {\"format\": {\"type\": \"text\" | \"json_object\" | "
                           "\"json_schema\", ...}}", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise api.APIError(f"text.format.type must be text, json_object or json_schema, got "
                       f"{fmt.get('type')!r}", "text.format")


def check_unsupported(body: dict) -> None:
    for name, noops in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in noops:
            raise api.APIError(f"'{name}' is not supported by this server; leave it out", name)
    include = body.get("include")
    if include is not None and not (isinstance(include, list)
                                    and all(isinstance(x, str) for x in include)):
        raise api.APIError("'include' must be a list of strings", "include")


def chat_body(body: dict, n_ctx: int, history: list) -> tuple[dict, list]:
    """(the chat completions body, this turn's conversation without the instructions)."""
    conversation = history + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise api.APIError("'instructions' must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = system + conversation
    out = sampling_fields(body)
    if "parallel_tool_calls" in body:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    asked = positive_int(body, "max_output_tokens")
    out.update(messages=messages, max_tokens=n_ctx if asked is None else asked)
    if body.get("tools") is not None:
        out["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise api.APIError("'reasoning' must be an object like {\"effort\": \"low\"}", "reasoning")
    if reasoning.get("effort") is not None:   # templates that know it read it (gpt-oss, ...)
        out["chat_template_kwargs"] = {"reasoning_effort": reasoning["effort"]}
    return out, conversation


def renamed(e: api.APIError) -> api.APIError:
    """A chat completions error named in the Responses API's fields."""
    if e.param is None:
        return e
    head = e.param.split("[", 1)[0].split(".", 1)[0]
    name = FIELD_NAMES.get(head)
    if name is None:
        return e
    message = str(e).replace(f"'{head}'", f"'{name}'")
    return api.APIError(message, name, e.status, e.type, e.code)


def parse(body, tokenizer, n_ctx: int, store: ResponseStore, tenant,
          special_in_content: bool = False) -> tuple[api.Request, Turn]:
    """The chat completions Request of a Responses body, and its Turn."""
    if not isinstance(body, dict):
        raise api.APIError("the request body must be a JSON object")
    check_unsupported(body)
    if "input" not in body:
        raise api.APIError("'input' is required", "input")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise api.APIError("'store' must be true or false", "store")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise api.APIError("'stream' must be true or false", "stream")
    history = []
    prev = body.get("previous_response_id")
    if prev is not None:
        found = store.get(tenant, prev) if isinstance(prev, str) else None
        if found is None:
            raise api.APIError(f"previous response {prev!r} not found (responses are kept "
                               f"{STORE_TTL_S:g} s, at most {STORE_MAX})",
                               "previous_response_id", code="not_found")
        history = [dict(m) for m in found[0]]
    chat, conversation = chat_body(body, n_ctx, history)
    try:
        req = api.parse("chat", chat, tokenizer, n_ctx, special_in_content)
    except api.APIError as e:
        raise renamed(e) from None
    req.stream = bool(stream)
    return req, Turn(_id("resp_"), body, body.get("tools") or [], conversation, tenant, keep)


# ---- the response ---------------------------------------------------------------------------

def usage(start, end, reasoning_tokens: int = 0) -> dict:
    prompt, out = end.prompt_tokens, end.generation_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": prompt - start.prompt_eval_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + out}


def response_object(turn: Turn, model: str, output: list, status: str, usage_=None,
                    error=None, finish_reason: str | None = None) -> dict:
    """The response object; status "incomplete" says why: the budget (finish_reason "length")
    or the server's drain deadline ("cancelled")."""
    b = turn.body
    incomplete = None if status != "incomplete" else {
        "reason": "cancelled" if finish_reason == "cancelled" else "max_output_tokens"}
    fmt = (b.get("text") or {}).get("format") if isinstance(b.get("text"), dict) else None
    return {"id": turn.rid, "object": "response", "created_at": turn.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": incomplete,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
            "store": turn.store, "temperature": b.get("temperature"),
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": b.get("tool_choice") or ("auto" if turn.tools else "none"),
            "tools": [{"strict": None, **t} for t in turn.tools], "top_p": b.get("top_p"),
            "truncation": "disabled", "usage": usage_, "user": b.get("user"),
            "metadata": b.get("metadata") or {}}


class ResponseBuilder:
    """Output items from replies' Pieces, and the streamed events that build them."""

    def __init__(self, turn: Turn, model: str, tokenizer):
        self.turn, self.model, self.tokenizer = turn, model, tokenizer
        self.output: list[dict] = []
        self.open: dict | None = None      # the message or reasoning item being written
        self.seq = 0
        self.start = self.end = None
        self.content, self.calls = "", []

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def begin(self) -> list[dict]:
        obj = response_object(self.turn, self.model, [], "in_progress")
        return [self.event("response.created", response=obj),
                self.event("response.in_progress", response=obj)]

    def feed(self, p: Piece) -> list[dict]:
        if p.kind == "start":
            self.start = p.last
            return []
        if p.kind == "reasoning":
            return self._write("reasoning", p.text)
        if p.kind == "text":
            self.content += p.text
            return self._write("message", p.text)
        if p.kind == "calls":
            return self._close() + [e for c in p.calls for e in self._call(c)]
        self.end = p.last               # "end"
        events = self._close()
        if not self.output:             # an empty reply is an empty message, not no output
            events += self._write("message", "") + self._close()
        return events

    def finish(self) -> dict:
        status = "completed" if self.end.finish_reason == "stop" else "incomplete"
        thought = "".join(c["text"] for item in self.output if item["type"] == "reasoning"
                          for c in item["content"])
        n_thought = len(self.tokenizer.encode(thought)) if thought else 0
        return response_object(self.turn, self.model, self.output, status,
                               usage(self.start, self.end, n_thought), None,
                               self.end.finish_reason)

    def failed(self, message: str) -> dict:
        obj = response_object(self.turn, self.model, self.output, "failed",
                              error={"code": "server_error", "message": message})
        return self.event("response.failed", response=obj)

    def conversation(self) -> list[dict]:
        """The stored conversation: this turn's, then the reply as an assistant message."""
        reply = {"role": "assistant", "content": self.content or None}
        if self.calls:
            reply["tool_calls"] = self.calls
        elif reply["content"] is None:
            reply["content"] = ""
        return self.turn.conversation + [reply]

    # -- items --
    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open(kind)
        item, i = self.open, len(self.output)
        item["content"][0]["text"] += text
        name = ("response.output_text.delta" if kind == "message"
                else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        if text:
            events.append(self.event(name, item_id=item["id"], output_index=i, content_index=0,
                                     delta=text, **extra))
        return events

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": _id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs_"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        i = len(self.output)
        events = [self.event("response.output_item.added", output_index=i, item=_copy(item)),
                  self.event("response.content_part.added", item_id=item["id"], output_index=i,
                             content_index=0, part=dict(part))]
        item["content"].append(part)
        self.open = item
        return events

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, part = len(self.output), item["content"][0]
        item["status"] = "completed"
        if item["type"] == "message":
            done = self.event("response.output_text.done", item_id=item["id"], output_index=i,
                              content_index=0, text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=i, content_index=0, text=part["text"])
        self.output.append(item)
        return [done, self.event("response.content_part.done", item_id=item["id"],
                                 output_index=i, content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=i, item=_copy(item))]

    def _call(self, call: dict) -> list[dict]:
        self.calls.append(call)
        f, i = call["function"], len(self.output)
        item = {"id": _id("fc_"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": f["name"], "arguments": ""}
        events = [self.event("response.output_item.added", output_index=i, item=dict(item)),
                  self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=i, delta=f["arguments"])]
        item.update(arguments=f["arguments"], status="completed")
        self.output.append(item)
        return events + [self.event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=i, name=f["name"], arguments=f["arguments"]),
                         self.event("response.output_item.done", output_index=i, item=dict(item))]


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


class Front:
    """The Responses API as app._serve_api drives it."""
    name = "responses"

    @staticmethod
    def parse(s, body, tenant):
        return parse(body, s.tokenizer, s.n_ctx, s.responses, tenant, s.special_in_content)

    @staticmethod
    def error_body(e: api.APIError) -> dict:
        return e.body()

    @staticmethod
    async def stream(s, req, turn: Turn, pieces):
        b = ResponseBuilder(turn, s.model_id, s.tokenizer)
        for e in b.begin():
            yield sse(e)
        try:
            async for p in pieces:
                for e in b.feed(p):
                    yield sse(e)
        except Exception as e:           # this request failed: the stream says so, and ends
            yield sse(b.failed(f"{type(e).__name__}: {e}"))
            return
        obj = b.finish()
        _keep(s, turn, b, obj)
        kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
        yield sse(b.event(kind, response=obj))

    @staticmethod
    async def whole(s, req, turn: Turn, pieces) -> dict:
        b = ResponseBuilder(turn, s.model_id, s.tokenizer)
        async for p in pieces:
            b.feed(p)
        obj = b.finish()
        _keep(s, turn, b, obj)
        return obj


def _keep(s, turn: Turn, b: ResponseBuilder, obj: dict) -> None:
    if turn.store:
        s.responses.put(turn.tenant, turn.rid, b.conversation(), obj)
