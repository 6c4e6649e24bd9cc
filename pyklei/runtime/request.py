"""One generation request, checked once where it is made and trusted below.

    req = make_request(model.n_ctx, tokenizer, prompt_ids, max_tokens=64,
                       params=SamplingParams(temperature=0.0), stop=["\\n"])
    for r in stream_request(model, tokenizer, req): ...      # pyklei.runtime.generate
    engine.submit_requests([req])                            # pyklei.runtime.engine

LLM, the CLI and the server make requests (the server from its own field-by-field HTTP checks,
which name the JSON field at fault); stream_generate and Engine.submit make one from their
keyword arguments. Below that -- Generation, the decoding loops, the engine's batches -- a
GenerationRequest is trusted as it is: nothing is checked twice.

The rules live here: the token budget (token_budget, shared with pyklei.chat and the bench),
stop strings (check_stops), log-probability counts, end-of-generation ids (default: the
tokenizer's, the one end-of-generation rule), token ids against the vocabulary (prompt and
logit_bias). The sampling options' own ranges are pyklei.runtime.sampler's SAMPLING_OPTIONS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .sampler import MAX_TOKENS, SamplingParams
from ..text.tokenizer import token_ids

MAX_TOP_LOGPROBS = 20          # alternatives per token at most (OpenAI's top_logprobs bound)
MAX_STOPS = 4                  # stop strings per server request (OpenAI's bound)
MAX_STOP_CHARS = 4096          # characters per server stop string (below: what the context holds)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked generation: make_request makes one; stream_request and the engine run it."""
    prompt: tuple[int, ...]          # token ids, each in the vocabulary; not empty
    max_tokens: int                  # the budget, fitted to the context (token_budget)
    params: SamplingParams           # checked when made (SAMPLING_OPTIONS); logit_bias ids in
                                     # the vocabulary
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] = ()    # the ids that end it (the tokenizer's unless given)
    logprobs: int | None = None      # alternatives to report per token (None: no logprobs)
    constraint: object = None        # a fresh pyklei.runtime.grammar.Constraint the reply follows
    speculative: object = None       # None, "lookup" or a draft Model, checked against the
                                     # model (pyklei.runtime.speculative.check_speculative)
    prediction: tuple[int, ...] = ()  # the reply's expected tokens (OpenAI's predicted outputs):
                                     # drafted by prompt lookup (pyklei.runtime.speculative)


def token_budget(n_ctx: int, n_prompt: int, max_tokens, trim: bool = False) -> int:
    """The number of tokens a generation may produce. max_tokens None or -1: the rest of the
    context. A count larger than the room left is an error, or with trim=True is cut to it (as
    chat() does, like llama-cpp-python). A prompt that leaves no room is always an error."""
    MAX_TOKENS.check(max_tokens)
    room = n_ctx - n_prompt
    if room < 1 and not (room == 0 and max_tokens == 0):
        raise ValueError(f"the prompt has {n_prompt} tokens and exceeds the context of {n_ctx} "
                         f"tokens with no room to generate; shorten the prompt or load with a "
                         f"larger n_ctx (--ctx-size)")
    if max_tokens is None or max_tokens == -1:
        return room
    if max_tokens > room and not trim:
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"context of {n_ctx} tokens; shorten the prompt, lower max_tokens "
                         f"(--max-tokens) or load with a larger n_ctx (--ctx-size)")
    return int(min(max_tokens, room))


def check_stops(stop, max_stops: int | None = None,
                max_chars: int | None = None) -> tuple[str, ...]:
    """Stop strings as a tuple: one string, or a list of strings (at most max_stops, each of
    at most max_chars characters: the server's bounds are MAX_STOPS and stop_chars_bound)."""
    if isinstance(stop, str):
        stops = (stop,)
    else:
        try:
            stops = tuple(stop)
        except TypeError:
            stops = None
        if stops is None or not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if max_stops is not None and len(stops) > max_stops:
        raise ValueError(f"stop has {len(stops)} strings; at most {max_stops}")
    if max_chars is not None and any(len(s) > max_chars for s in stops):
        raise ValueError(f"a stop string has {max(map(len, stops))} characters; at most "
                         f"{max_chars}")
    return stops


def stop_chars_bound(n_ctx: int, max_token_chars: int) -> int:
    """The longest stop string a server takes: MAX_STOP_CHARS, or less where a whole context
    of text (n_ctx tokens of at most max_token_chars characters) could not hold a longer one,
    which could then never match."""
    return min(MAX_STOP_CHARS, n_ctx * max_token_chars)


def check_depth(obj, limit: int) -> None:
    """ValueError when JSON data nests deeper than `limit` (what walks it later -- close_objects,
    a schema compiler, a chat template -- recurses that deep). Iterative, so a deep value cannot
    overflow the check itself."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            raise ValueError(f"it nests deeper than {limit} levels")
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))


def check_logprobs(logprobs, name: str = "logprobs") -> int | None:
    """None (no logprobs) or the alternatives to report per token, an integer in
    [0, MAX_TOP_LOGPROBS]; `name` is the field the message names (the server's top_logprobs)."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives "
                         f"per token), got {logprobs!r}")
    return logprobs


def check_logit_bias_ids(logit_bias, vocab_size: int) -> None:
    """logit_bias ((id, bias) pairs sorted by id, as check_logit_bias makes them): every id in
    the vocabulary."""
    if logit_bias and logit_bias[-1][0] >= vocab_size:
        raise ValueError(f"logit_bias: token id {logit_bias[-1][0]} is outside the "
                         f"vocabulary [0, {vocab_size})")


def check_params(params: SamplingParams | None, vocab_size: int) -> SamplingParams:
    """params (None: the defaults), its logit_bias ids checked against the vocabulary (the
    options' own ranges were checked when it was made)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a pyklei.sampler.SamplingParams, got {params!r}")
    check_logit_bias_ids(params.logit_bias, vocab_size)
    return params


def prediction_ids(tokenizer, prediction) -> tuple[int, ...]:
    """The token ids of a prediction: text (encoded as plain text, no BOS: it stands for the
    reply), token ids, or None (none)."""
    if prediction is None:
        return ()
    if isinstance(prediction, str):
        return tuple(tokenizer.encode(prediction, add_bos=False, parse_special=False,
                                      add_eos=False))
    if isinstance(prediction, dict):    # OpenAI's HTTP shape, {"type": "content", ...}
        raise TypeError("prediction must be the expected text (a str) or its token ids; the "
                        "{\"type\": \"content\", ...} object is the HTTP API's shape")
    try:
        return tuple(token_ids(prediction, tokenizer.vocab_size))
    except (TypeError, ValueError) as e:
        raise type(e)(f"prediction must be the expected text (a str) or its token ids: "
                      f"{e}") from None


def make_request(n_ctx: int, tokenizer, prompt: Sequence[int], max_tokens=256,
                 params: SamplingParams | None = None, stop: str | Sequence[str] = (),
                 eos_ids: Sequence[int] | None = None, logprobs: int | None = None,
                 constraint=None, trim: bool = False, speculative=None,
                 prediction=None) -> GenerationRequest:
    """A GenerationRequest for a context of n_ctx tokens, or the TypeError / ValueError that
    names what is wrong. prompt: token ids. max_tokens: see token_budget (trim: cut to the
    room left instead of refusing). eos_ids: None for the tokenizer's. constraint: a fresh
    pyklei.runtime.grammar.Constraint (not claimed here: the generation that runs it claims it).
    speculative: what pyklei.runtime.speculative.check_speculative returned for the model (the caller
    holds the model; this module does not). prediction: the reply's expected text or token ids
    (prediction_ids), drafted from by prompt lookup whatever `speculative` says."""
    vocab = tokenizer.vocab_size
    prompt = tuple(token_ids(prompt, vocab))
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    params = check_params(params, vocab)
    eos = tuple(tokenizer.eos_ids) if eos_ids is None else tuple(token_ids(eos_ids, vocab))
    return GenerationRequest(prompt=prompt,
                             max_tokens=token_budget(n_ctx, len(prompt), max_tokens, trim=trim),
                             params=params, stop=check_stops(stop), eos_ids=eos,
                             logprobs=check_logprobs(logprobs), constraint=constraint,
                             speculative=speculative,
                             prediction=prediction_ids(tokenizer, prediction))
