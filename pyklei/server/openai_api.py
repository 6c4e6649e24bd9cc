"""OpenAI's request and response shapes, checked against pyklei's own schema.

A request body becomes a `Request` (prompt token ids, token budget, stops, SamplingParams,
stream flags) or an `APIError` whose `param` names the field at fault. The sampling fields are
checked by pyklei.sampler.SAMPLING_OPTIONS under their own names (temperature, top_p, seed,
and the extensions top_k, min_p, repetition_penalty, repetition_window), max_tokens by
pyklei.generate.token_budget, chat messages by the model's template through
Tokenizer.apply_chat_template: the same rules and messages as the Python API and the CLI.

Fields the server does not implement (tools, response_format, logprobs, n > 1, ...) are a 400
unless they hold their no-op value (`"n": 1`, `"logprobs": false`, `"tools": []`): a client
must never get a 200 that silently ignored what it asked for. Other unknown fields (`user`,
`metadata`) are ignored, as OpenAI-compatible servers commonly do.

Chat responses, chunks and usage are built here too (`completion`, `chunk`, `usage`), so the
HTTP layer (app.py) only moves bytes.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..chat_template import ChatTemplateError
from ..generate import GenerationResponse, token_budget
from ..sampler import MAX_TOKENS, SAMPLING_OPTIONS, SamplingParams
from ..tokenizer import token_ids

DEFAULT_MAX_TOKENS = {"chat": 512, "text": 16}   # when a request gives none (text: OpenAI's)
MAX_STOPS = 16
ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "developer": "system"}   # OpenAI: developer messages take the place of system messages


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


# field -> (is its value a no-op?, what to say). A field absent or null is always fine.
def _falsy(v):
    return v is False or v == 0 or v == [] or v == {}


UNSUPPORTED = {
    "tools": (lambda v: v == [], "tool calling is not supported"),
    "tool_choice": (lambda v: v == "none", "tool calling is not supported"),
    "functions": (lambda v: v == [], "function calling is not supported"),
    "function_call": (lambda v: v == "none", "function calling is not supported"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "tool calling is not supported"),
    "response_format": (lambda v: v == {"type": "text"}, "JSON mode and structured outputs "
                        "are not supported (only {\"type\": \"text\"})"),
    "logprobs": (_falsy, "logprobs are not supported"),
    "top_logprobs": (_falsy, "logprobs are not supported"),
    "logit_bias": (_falsy, "logit_bias is not supported"),
    "n": (lambda v: v == 1 and not isinstance(v, bool),
          "several choices are not supported (only n=1)"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of is not supported"),
    "echo": (lambda v: v is False, "echo is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
    "presence_penalty": (_falsy, "presence_penalty is not supported (pyklei's "
                                 "repetition_penalty is)"),
    "frequency_penalty": (_falsy, "frequency_penalty is not supported (pyklei's "
                                  "repetition_penalty is)"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "modalities other than text are not supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
}


@dataclass
class Request:
    kind: str                    # "chat" or "text"
    ids: list[int]               # the prompt's token ids
    max_tokens: int              # the budget, already fitted to the context
    stop: list[str]
    params: SamplingParams
    stream: bool
    include_usage: bool


def check_unsupported(body: dict) -> None:
    for name, (noop, why) in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not noop(v):
            raise APIError(f"'{name}': {why}; leave it out", name)


def sampling_from(body: dict) -> SamplingParams:
    """The request's sampling fields, each checked by pyklei's schema (its default if absent)."""
    kw = {}
    for o in SAMPLING_OPTIONS:
        v = body.get(o.name)
        if o is MAX_TOKENS or v is None:
            continue
        try:
            kw[o.name] = o.check(v)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), o.name) from None
    return SamplingParams(**kw)


def stops_from(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) for s in stop):
        return stop
    raise APIError(f"'stop' must be a string or a list of up to {MAX_STOPS} strings", "stop")


def _message_text(i: int, m: dict) -> str:
    content = m.get("content")
    if isinstance(content, list):       # [{"type": "text", "text": "..."}, ...]
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(f"messages[{i}].content[{j}]: only text parts "
                               f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                               f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                       f"messages[{i}].content")
    return content


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object with 'role' and 'content'",
                           f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            hint = " (tool calling is not supported)" if role in ("tool", "function") else ""
            raise APIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{role!r}{hint}", f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise APIError(f"messages[{i}]: tool calls are not supported", f"messages[{i}]")
        out.append({"role": ROLES[role], "content": _message_text(i, m)})
    return out


def check_length(kind: str, texts, n_texts: int, tokenizer, n_ctx: int) -> None:
    """400 for a prompt that cannot fit the context, found without tokenizing or templating it:
    every token stands for at most tokenizer.max_token_chars characters, and every message of a
    chat template for at least one token. Tokenizing a text of megabytes holds the GIL for a
    second, which every other stream would feel."""
    param = "messages" if kind == "chat" else "prompt"
    if n_texts > n_ctx:
        raise APIError(f"{n_texts} messages cannot fit the context of {n_ctx} tokens", param)
    chars = sum(map(len, texts))
    if chars > tokenizer.max_token_chars * n_ctx:
        raise APIError(f"the {param} has {chars} characters: more than the context of {n_ctx} "
                       f"tokens can hold (at most {tokenizer.max_token_chars} characters a token)",
                       param)


def prompt_ids(kind: str, body: dict, tokenizer, n_ctx: int) -> list[int]:
    if kind == "chat":
        messages = chat_messages(body)
        check_length(kind, (m["content"] for m in messages), len(messages), tokenizer, n_ctx)
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (ChatTemplateError, ValueError, TypeError) as e:
            raise APIError(f"cannot render the model's chat template: {e}", "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]            # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        check_length(kind, (prompt,), 1, tokenizer, n_ctx)
        return tokenizer.encode(prompt, parse_special=True)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            return token_ids(prompt, tokenizer.vocab_size)
        except (TypeError, ValueError) as e:
            raise APIError(f"'prompt': {e}", "prompt") from None
    raise APIError("'prompt' must be a non-empty string or list of token ids (one prompt: "
                   "batches are not supported)", "prompt")


def parse(kind: str, body, tokenizer, n_ctx: int) -> Request:
    """Checks a request body (parsed JSON) for one model with n_ctx tokens of context."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    check_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise APIError("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict)
                                 and isinstance(opts.get("include_usage", False), bool)):
        raise APIError("'stream_options' must be an object like {\"include_usage\": true}",
                       "stream_options")
    params = sampling_from(body)
    stop = stops_from(body)
    ids = prompt_ids(kind, body, tokenizer, n_ctx)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    try:   # a default is cut to the room left; a count asked for must fit
        budget = token_budget(n_ctx, len(ids), DEFAULT_MAX_TOKENS[kind] if asked is None else asked,
                              trim=asked is None)
    except (TypeError, ValueError) as e:
        fits = isinstance(e, TypeError) or len(ids) < n_ctx
        raise APIError(str(e).replace("max_tokens", key), key if fits else
                       "messages" if kind == "chat" else "prompt") from None
    return Request(kind, ids, budget, stop, params, bool(stream),
                   bool((opts or {}).get("include_usage")))


# ---- responses ------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(r: GenerationResponse) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.generation_tokens,
            "total_tokens": r.prompt_tokens + r.generation_tokens}


def timings(r: GenerationResponse) -> dict:
    """pyklei's extension beside usage: the speeds of this request, as the server saw them."""
    return {"time_to_first_token_s": r.time_to_first_token, "prompt_tok_s": r.prompt_tps,
            "generation_tok_s": r.generation_tps, "prompt_cached_tokens":
            r.prompt_tokens - r.prompt_eval_tokens}


def completion(kind: str, rid: str, model: str, text: str, last: GenerationResponse) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(last), "timings": timings(last)}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None,
          finish: str | None = None, first: bool = False, last: GenerationResponse | None = None
          ) -> dict:
    """One streamed chunk: a piece of text (with finish_reason on the last piece), or with
    `last` the closing usage chunk, whose choices are empty (OpenAI's include_usage)."""
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": created, "model": model}
    if last is not None:
        out.update(choices=[], usage=usage(last), timings=timings(last))
    elif kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": None,
                           "finish_reason": finish}]
    return out
