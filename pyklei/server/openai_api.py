"""OpenAI's request and response shapes, checked against pyklei's own schema.

A request body becomes a `Request` (prompt token ids, token budget, stops, SamplingParams,
stream flags) or an `APIError` whose `param` names the field at fault. The sampling fields are
checked by pyklei.runtime.sampler.SAMPLING_OPTIONS under their own names (temperature, top_p, seed,
and the extensions top_k, min_p, repetition_penalty, repetition_window), max_tokens by
pyklei.runtime.request.token_budget, chat messages by the model's template through
Tokenizer.apply_chat_template: the same rules and messages as the Python API and the CLI.

Steering fields: logprobs/top_logprobs, n, logit_bias, presence/frequency penalties, echo;
response_format and llama.cpp's json_schema / grammar fields become a pyklei.runtime.grammar constraint;
tools / tool_choice / tool messages go through pyklei.text.tool_calls (tool_choice "required" or a named
function is a constraint too); prediction (predicted outputs) drafts by prompt lookup from the
predicted text, and usage.completion_tokens_details counts the drafted tokens accepted and
rejected. Fields the server does not implement (suffix, audio, ...) are a 400 unless they hold
their no-op value: a client must never get a 200 that silently ignored what it asked for.
Other unknown fields (`user`, `metadata`) are ignored, as OpenAI-compatible servers commonly do.

Chat responses, chunks and usage are built here too (`completion`, `chunk`, `usage`), so the
HTTP layer (app.py) only moves bytes.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..text.chat_template import ChatTemplateError, check_template_kwargs
from ..text.reasoning import reasoning_for
from dataclasses import replace

from ..runtime.generate import GenerationResponse, TokenLogprob
from ..runtime.request import (MAX_STOPS, GenerationRequest, check_logit_bias_ids, check_logprobs,
                               check_stops, prediction_ids, stop_chars_bound, token_budget)
from ..runtime.sampler import MAX_TOKENS, SAMPLING_OPTIONS, SamplingParams, check_logit_bias
from ..text.tokenizer import token_ids
from ..text.tool_calls import ToolError, check_tool_choice, check_tools, has_tool_turns
from ..text.tool_calls import forced_calls, reply_parser
from ..text.tool_calls import render as render_with_tools

DEFAULT_MAX_TOKENS = {"chat": 512, "text": 16}   # when a request gives none (text: OpenAI's)
MAX_N = 16                    # choices per request
# log-probability entries (a token or an alternative) one reply may hold, over its choices and
# an echoed prompt's: ~50 bytes of JSON each, so at most ~13 MB. An echoed 3,900-token prompt
# with 20 alternatives and n=16 was a 36 MB reply (1.3M entries); n=16 replies of 2,000 tokens
# fit with 7 alternatives, one reply of 12,000 tokens with 20.
MAX_LOGPROB_ENTRIES = 1 << 18
MAX_CACHE_SALT = 256          # characters
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool",      # the legacy functions API: a function's result
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
UNSUPPORTED = {
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "modalities other than text are not supported"),
}


@dataclass
class Request:
    kind: str                    # "chat" or "text"
    ids: list[int]               # the prompt's token ids
    max_tokens: int              # the budget, already fitted to the context
    stop: tuple[str, ...]
    params: list[SamplingParams]   # one per choice (n); seeds differ
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives per token, None: no logprobs
    echo: bool = False           # completions: the prompt's text before each choice's
    prompt_text: str = ""
    tools: list = field(default_factory=list)   # offered (empty with tool_choice "none")
    tool_choice: object = "none"
    parallel_tool_calls: bool = True
    constraint: object = None    # pyklei.runtime.grammar.Constraint the reply follows (first choice)
    legacy_functions: bool = False   # answer a call as message.function_call (legacy API)
    calls: object = None         # pyklei.text.tool_calls.CallParser of the reply; None: it is content
    best_of: int | None = None   # completions: choices generated, of which n are returned
    n: int = 1
    prediction: tuple[int, ...] = ()   # predicted outputs: the reply's expected token ids
    cache_salt: str | None = None  # divides the tenant's prefix cache (app.py's module doc)
    reasoning: object = None     # pyklei.text.reasoning.Reasoning of a thinking model's reply

    def generations(self, eos_ids) -> list[GenerationRequest]:
        """The engine's requests, one per choice (the first follows `constraint`, the others
        fresh copies of it); each field was checked when this request was parsed."""
        logprobs = 0 if self.best_of and self.logprobs is None else self.logprobs
        c = self.constraint
        return [GenerationRequest(prompt=tuple(self.ids), max_tokens=self.max_tokens, params=p,
                                  stop=self.stop, eos_ids=tuple(eos_ids), logprobs=logprobs,
                                  constraint=c if c is None or i == 0 else c.fresh(),
                                  prediction=self.prediction)
                for i, p in enumerate(self.params)]


def check_unsupported(body: dict) -> None:
    for name, (noop, why) in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not noop(v):
            raise APIError(f"'{name}': {why}; leave it out", name)


def sampling_from(body: dict, vocab_size: int) -> SamplingParams:
    """The request's sampling fields, each checked by pyklei's schema (its default if absent),
    and logit_bias (token ids of this vocabulary)."""
    kw = {}
    for o in SAMPLING_OPTIONS:
        v = body.get(o.name)
        if o is MAX_TOKENS or v is None:
            continue
        try:
            kw[o.name] = o.check(v)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), o.name) from None
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError("'logit_bias' must be an object mapping token ids to numbers in "
                           "[-100, 100]", "logit_bias")
        try:
            kw["logit_bias"] = check_logit_bias(bias)
            check_logit_bias_ids(kw["logit_bias"], vocab_size)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), "logit_bias") from None
    return SamplingParams(**kw)


def _int_field(body: dict, name: str, lo: int, hi: int, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise APIError(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def best_of_from(kind: str, body: dict) -> int | None:
    """Completions' best_of: how many choices to generate, of which the n with the highest
    log-probability per token are returned (OpenAI's rule; not streamed). None: n."""
    n = _int_field(body, "n", 1, MAX_N, 1)
    best = _int_field(body, "best_of", 1, MAX_N, None) if kind == "text" else None
    if kind == "chat" and body.get("best_of") not in (None, 1):
        raise APIError("'best_of' is a field of /v1/completions (chat takes n)", "best_of")
    if best is None or best == n:
        return None
    if best < n:
        raise APIError(f"'best_of' ({best}) must be at least 'n' ({n})", "best_of")
    if body.get("stream"):
        raise APIError("'best_of' cannot be streamed: the best choices are known at the end",
                       "best_of")
    return best


def choices_from(body: dict, params: SamplingParams, count: int | None = None
                 ) -> list[SamplingParams]:
    """n (or `count`) SamplingParams: choice i samples with seed + i (each its own stream of
    random numbers, reproducible), or at random when no seed is given."""
    n = count or _int_field(body, "n", 1, MAX_N, 1)
    if params.seed is None or params.seed == -1:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % 2 ** 64) for i in range(n)]


def logprobs_from(kind: str, body: dict) -> int | None:
    """Alternatives per token to report, or None. Chat: logprobs true/false and top_logprobs
    (0-20); completions: logprobs an integer (0-20, OpenAI's legacy field)."""
    if kind == "chat":
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise APIError("'logprobs' must be true or false", "logprobs")
        top = _logprobs_field(body, "top_logprobs")
        if top is not None and not on:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return _logprobs_field(body, "logprobs")


def _logprobs_field(body: dict, name: str) -> int | None:
    try:
        return check_logprobs(body.get(name), name)
    except ValueError as e:
        raise APIError(str(e), name) from None


def stops_from(body: dict, tokenizer, n_ctx: int) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    chars = stop_chars_bound(n_ctx, tokenizer.max_token_chars)
    try:
        if not isinstance(stop, (str, list)):
            raise TypeError
        return check_stops(stop, MAX_STOPS, chars)
    except (TypeError, ValueError):
        raise APIError(f"'stop' must be a string or a list of up to {MAX_STOPS} strings of at "
                       f"most {chars} characters", "stop") from None


def prediction_from(body: dict, tokenizer, n_ctx: int) -> tuple[int, ...]:
    """OpenAI's predicted outputs: {"type": "content", "content": text or [text parts]}, the
    reply's expected text (the code an edit rewrites): its token ids, drafted from by prompt
    lookup. The reply is the same as without it (drafts are checked); it only comes sooner."""
    p = body.get("prediction")
    if p is None:
        return ()
    shape = "'prediction' must be {\"type\": \"content\", \"content\": the expected text}"
    if not isinstance(p, dict) or p.get("type") != "content" or set(p) - {"type", "content"}:
        raise APIError(shape, "prediction")
    content = p.get("content")
    if isinstance(content, list):
        if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
                   for x in content):
            raise APIError("'prediction.content' parts must be text parts ({\"type\": \"text\", "
                           "\"text\": ...})", "prediction")
        content = "".join(x["text"] for x in content)
    if not isinstance(content, str):
        raise APIError(shape, "prediction")
    if len(content) > tokenizer.max_token_chars * n_ctx:   # found before tokenizing (check_length)
        raise APIError(f"'prediction' has {len(content)} characters, more than a reply can be "
                       f"in the context of {n_ctx} tokens", "prediction")
    ids = prediction_ids(tokenizer, content)
    if len(ids) > n_ctx:
        raise APIError(f"'prediction' is {len(ids)} tokens, more than a reply can be in the "
                       f"context of {n_ctx} tokens", "prediction")
    return ids


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
            raise APIError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                           f"{role!r}", f"messages[{i}].role")
        legacy = m.get("function_call")
        if legacy is not None:      # the legacy functions API: one call, no id
            if role != "assistant" or not isinstance(legacy, dict):
                raise APIError(f"messages[{i}].function_call must be an assistant's "
                               f"{{\"name\", \"arguments\"}}", f"messages[{i}].function_call")
            m = {**m, "tool_calls": [{"id": _legacy_id(legacy.get("name")), "type": "function",
                                      "function": legacy}]}
        if role == "function":
            m = {**m, "tool_call_id": _legacy_id(m.get("name"))}
        calls = m.get("tool_calls")
        msg = {"role": ROLES[role]}
        if calls:
            if role != "assistant":
                raise APIError(f"messages[{i}]: only assistant messages carry tool_calls",
                               f"messages[{i}].tool_calls")
            msg["tool_calls"] = _tool_calls(i, calls)
            msg["content"] = None if m.get("content") is None else _message_text(i, m)
        else:
            msg["content"] = _message_text(i, m)
        if ROLES[role] == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                raise APIError(f"messages[{i}].tool_call_id must be the id of the call it answers",
                               f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def _legacy_id(name) -> str:
    """The id that ties a legacy function_call to its function result (the legacy API has
    none: they are paired by name)."""
    return f"call_{name}"


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(
                f.get("arguments", ""), str):
            raise APIError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", "
                           f"\"function\": {{\"name\", \"arguments\": JSON text}}}}", where)
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "{}")}})
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


def tools_from(body: dict) -> tuple[list[dict], object, bool, bool]:
    """(tools, tool_choice, parallel_tool_calls, legacy), checked; tools [] when none are
    offered or tool_choice is "none". legacy: the request used the legacy `functions` /
    `function_call` (one call at most, answered as message.function_call)."""
    legacy = body.get("functions") is not None or body.get("function_call") is not None
    if legacy and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise APIError("give 'tools' or the legacy 'functions', not both", "functions")
    names = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    offered = body.get(names[0]) or []
    choice = body.get(names[1])
    if legacy:
        if not isinstance(offered, list):
            raise APIError("'functions' must be a list of {\"name\", \"parameters\"}",
                           "functions")
        offered = [{"type": "function", "function": f} for f in offered]
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice}
    try:
        tools = check_tools(offered)
    except ToolError as e:
        raise APIError(str(e).replace("tools[", f"{names[0]}[").replace("'tools'", names[0]),
                       names[0]) from None
    try:
        choice = check_tool_choice(choice, tools)
    except ToolError as e:
        raise APIError(str(e), names[1]) from None
    if legacy:
        return (tools if choice != "none" else []), choice, False, True
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return (tools if choice != "none" else []), choice, parallel, False


CONSTRAINTS = ("response_format", "json_schema", "grammar")   # the last two: llama.cpp's


def client_constraints(body: dict) -> list[str]:
    """The constraint fields the client gave (response_format {"type": "text"} is none)."""
    return [k for k in CONSTRAINTS if body.get(k) is not None
            and not (k == "response_format" and body[k] == {"type": "text"})]


def constraint_from(body: dict, tokenizer, tools: list, tool_choice, parallel: bool):
    """The reply's constraint (pyklei.runtime.grammar): OpenAI's response_format, llama.cpp's
    json_schema or grammar fields, or the calls that tool_choice "required" or a named function
    demands. None when nothing constrains the reply."""
    given = client_constraints(body)
    forced = tools and (tool_choice == "required" or isinstance(tool_choice, dict))
    if len(given) + bool(forced) > 1:
        names = given + (["tool_choice"] if forced else [])
        raise APIError(f"give at most one of {', '.join(names)}", names[-1])
    if not given and not forced:
        return None
    param = given[0] if given else "tool_choice"
    try:
        from ..runtime.grammar import constraint
        if forced:
            return constraint(tokenizer, tool_calls=forced_calls(tools, tool_choice, parallel,
                                                                 tokenizer.chat_template))
        return constraint(tokenizer, **{param: body[param]})
    except ImportError as e:
        raise APIError(f"'{param}' needs constrained decoding, which this server lacks: {e}",
                       param) from None
    except (TypeError, ValueError) as e:    # GrammarError is a ValueError
        raise APIError(f"'{param}': {e}", param) from None


def template_kwargs_from(body: dict) -> dict:
    """vLLM's and llama.cpp's chat_template_kwargs: more variables for the chat template
    (``{"enable_thinking": false}`` turns Qwen3's thinking off)."""
    try:
        return check_template_kwargs(body.get("chat_template_kwargs"))
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "chat_template_kwargs") from None


def prompt_ids(kind: str, body: dict, tokenizer, n_ctx: int, tools=(),
               special_in_content: bool = False) -> list[int]:
    """The prompt's token ids. A chat's message content is text: special tokens only where the
    template writes them, unless special_in_content (serve --special-in-content)."""
    if kind == "chat":
        messages = chat_messages(body)
        check_length(kind, (m["content"] or "" for m in messages), len(messages), tokenizer,
                     n_ctx)
        kw = template_kwargs_from(body)
        try:
            if tools or has_tool_turns(messages):
                return render_with_tools(tokenizer, messages, list(tools) or None,
                                         parse_special_in_content=special_in_content,
                                         template_kwargs=kw)
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                parse_special_in_content=special_in_content, **kw)
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


def cache_salt_from(body: dict) -> str | None:
    """vLLM's cache_salt: requests reuse cached prompt prefixes only of requests with the same
    salt (and API key)."""
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT):
        raise APIError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} "
                       f"characters", "cache_salt")
    return salt


def check_logprob_size(kind: str, logprobs: int | None, choices: int, n_prompt: int,
                       echo: bool, budget: int) -> None:
    """400 when the reply's log-probabilities could exceed MAX_LOGPROB_ENTRIES (module
    constant): every choice carries its tokens' and, echoed, the prompt's."""
    if logprobs is None:
        return
    entries = choices * ((n_prompt if echo else 0) + budget) * (logprobs + 1)
    if entries > MAX_LOGPROB_ENTRIES:
        param = "top_logprobs" if kind == "chat" else "logprobs"
        raise APIError(f"this reply could hold {entries} log-probabilities ({choices} choices x "
                       f"{(n_prompt if echo else 0) + budget} tokens x {logprobs + 1}), more than "
                       f"{MAX_LOGPROB_ENTRIES}: ask for fewer alternatives, choices or tokens",
                       param)


def parse(kind: str, body, tokenizer, n_ctx: int, special_in_content: bool = False) -> Request:
    """Checks a request body (parsed JSON) for one model with n_ctx tokens of context.
    special_in_content: parse special tokens in chat message content (prompt_ids)."""
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
    best_of = best_of_from(kind, body)
    params = choices_from(body, sampling_from(body, tokenizer.vocab_size), best_of)
    logprobs = logprobs_from(kind, body)
    echo = body.get("echo", False) if kind == "text" else False
    if not isinstance(echo, bool):
        raise APIError("'echo' must be true or false", "echo")
    stop = stops_from(body, tokenizer, n_ctx)
    tools, tool_choice, parallel, legacy = (tools_from(body) if kind == "chat"
                                            else ([], "none", True, False))
    ids = prompt_ids(kind, body, tokenizer, n_ctx, tools, special_in_content)
    where = "messages" if kind == "chat" else "prompt"
    if len(ids) >= n_ctx:
        raise APIError(f"the {where} is {len(ids)} tokens: it leaves no room to generate in the "
                       f"context of {n_ctx} tokens a sequence has here", where)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    try:   # cut to the room left (finish_reason "length" says so), as llama-cpp-python does
        budget = token_budget(n_ctx, len(ids), DEFAULT_MAX_TOKENS[kind] if asked is None else asked,
                              trim=True)
    except (TypeError, ValueError) as e:
        raise APIError(str(e).replace("max_tokens", key), key) from None
    check_logprob_size(kind, logprobs, len(params), len(ids), echo, budget)
    salt = cache_salt_from(body)
    constrained = constraint_from(body, tokenizer, tools, tool_choice, parallel)
    calls = reply_parser(tools, tokenizer.chat_template, chat_messages(body) if tools else (),
                         tool_choice, constrained=bool(client_constraints(body)))
    prompt_text = "" if not echo else (body["prompt"] if isinstance(body.get("prompt"), str)
                                       else tokenizer.decode(ids))
    return Request(kind=kind, ids=ids, max_tokens=budget, stop=stop, params=params,
                   stream=bool(stream), include_usage=bool((opts or {}).get("include_usage")),
                   logprobs=logprobs, echo=echo, prompt_text=prompt_text, tools=tools,
                   tool_choice=tool_choice, parallel_tool_calls=parallel,
                   constraint=constrained, legacy_functions=legacy, calls=calls, best_of=best_of,
                   n=_int_field(body, "n", 1, MAX_N, 1),
                   prediction=prediction_from(body, tokenizer, n_ctx), cache_salt=salt,
                   reasoning=reasoning_for(tokenizer, ids) if kind == "chat" else None)


# ---- responses ------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(lasts: list[GenerationResponse]) -> dict:
    """One request's usage: the prompt once, the tokens of every choice; where speculative
    decoding drafted (serve --lookup, --draft-model, a prediction), completion_tokens_details
    counts the drafted tokens accepted and rejected under OpenAI's predicted-outputs names
    (the tokens generated are the same either way)."""
    prompt = lasts[0].prompt_tokens
    completion = sum(r.generation_tokens for r in lasts)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           # OpenAI's count of prompt tokens that came from the (request's own) prefix cache
           "prompt_tokens_details": {"cached_tokens": prompt - lasts[0].prompt_eval_tokens}}
    drafted = sum(r.drafted_tokens for r in lasts)
    if drafted:
        accepted = sum(r.accepted_tokens for r in lasts)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def timings(r: GenerationResponse) -> dict:
    """pyklei's extension beside usage: the speeds of this request (its first choice), as the
    server saw them."""
    out = {"time_to_first_token_s": r.time_to_first_token, "prompt_tok_s": r.prompt_tps,
           "generation_tok_s": r.generation_tps, "prompt_cached_tokens":
           r.prompt_tokens - r.prompt_eval_tokens}
    if r.drafted_tokens:    # llama.cpp's server's names for its speculative decoding
        out.update(draft_n=r.drafted_tokens, draft_n_accepted=r.accepted_tokens)
    return out


class Logprobs:
    """GenerationResponse.logprobs in OpenAI's two shapes. Chat: {"content": [{"token",
    "logprob", "bytes", "top_logprobs": [...]}]}. Completions (legacy): {"tokens",
    "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, offsets counted in
    characters from the start of the choice's text (after an echoed prompt)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _piece(self, token: int) -> tuple[str, list[int]]:
        b = self.tokenizer.token_to_piece(token)
        return b.decode("utf-8", "replace"), list(b)

    def chat(self, lps) -> dict:
        out = []
        for lp in lps:
            text, raw = self._piece(lp.token)
            top = []
            for t, v in lp.top:
                tt, tb = self._piece(t)
                top.append({"token": tt, "logprob": v, "bytes": tb})
            out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": out}

    def text(self, lps, offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self._piece(lp.token)
            tokens.append(text)
            values.append(lp.logprob)     # None for an echoed prompt's first token
            tops.append({self._piece(t)[0]: v for t, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def _choice(kind: str, index: int, text: str, finish: str | None, logprobs,
            parser=None, legacy: bool = False, reasoning=None) -> dict:
    """One choice of a whole response; a thinking model's reply split by `reasoning`
    (pyklei.text.reasoning.Reasoning) into message.reasoning_content and .reasoning (llama.cpp's
    and vLLM's names; both, so either kind of client finds it) and content; the content read
    for tool calls by `parser` (pyklei.text.tool_calls.CallParser) when there is one."""
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            thought, message["content"] = reasoning.split(text)
            message["reasoning_content"] = message["reasoning"] = thought
            text = message["content"]
        if parser is not None:
            content, calls = parser.parse(text)
            message["content"] = content
            if calls and legacy:
                message["function_call"] = calls[0]["function"]
                finish = "function_call"
            elif calls:
                message["tool_calls"] = calls
                finish = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def prompt_logprobs(req: Request, lps) -> list:
    """An echoed prompt's logprobs (GenerationResponse.prompt_logprobs), its first token, which
    has none, included as logprob None (OpenAI's shape)."""
    if not req.echo or not lps:
        return []
    return [TokenLogprob(req.ids[0], None, ())] + list(lps[1:])


def best_choices(req: Request, lps: list[list]) -> list[int]:
    """The indices of the n choices with the highest mean log-probability per token."""
    def score(i):
        return sum(lp.logprob for lp in lps[i]) / max(len(lps[i]), 1)
    return sorted(sorted(range(len(lps)), key=score, reverse=True)[:req.n])


def completion(req: Request, rid: str, model: str, texts: list[str],
               lasts: list[GenerationResponse], lps: list[list] | None, shape: Logprobs,
               prompt_lps: list | None = None) -> dict:
    """A whole (non-streamed) response: one choice per text, its last response and logprobs
    (after the echoed prompt's, if any)."""
    choices = []
    for i, (text, last) in enumerate(zip(texts, lasts)):
        logprobs = None
        if lps is not None:
            logprobs = shape.chat(lps[i]) if req.kind == "chat" else shape.text(
                prompt_logprobs(req, prompt_lps) + lps[i], 0)
        choices.append(_choice(req.kind, i, req.prompt_text + text, last.finish_reason,
                               logprobs, req.calls, req.legacy_functions, req.reasoning))
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(lasts), "timings": timings(lasts[0])}


def tool_call_chunk(rid: str, created: int, model: str, index: int, content: str | None,
                    calls: list[dict], legacy: bool = False) -> dict:
    """A streamed choice's tool calls, whole, in one chunk (each call's arguments complete:
    clients concatenate argument deltas, so one delta is valid), finish_reason "tool_calls"
    (legacy: the first call as delta.function_call, finish_reason "function_call")."""
    if legacy:
        delta, finish = {"function_call": calls[0]["function"]}, "function_call"
    else:
        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        finish = "tool_calls"
    if content:
        delta["content"] = content
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None,
          finish: str | None = None, first: bool = False,
          lasts: list[GenerationResponse] | None = None, index: int = 0, logprobs=None,
          reasoning: str | None = None) -> dict:
    """One streamed chunk of choice `index`: a piece of text (with finish_reason on the last
    piece), a piece of a thinking model's reasoning (delta.reasoning_content and
    delta.reasoning, as _choice names it), and its tokens' logprobs, or with `lasts` the
    closing usage chunk, whose choices are empty (OpenAI's include_usage)."""
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": created, "model": model}
    if lasts is not None:
        out.update(choices=[], usage=usage(lasts), timings=timings(lasts[0]))
    elif kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs,
                           "finish_reason": finish}]
    else:
        out["choices"] = [{"index": index, "text": text or "", "logprobs": logprobs,
                           "finish_reason": finish}]
    return out
