"""Streaming generation: prompt tokens in, text pieces out, with stop handling and stats.

    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=64):
        print(r.text, end="")           # r.finish_reason is set on the last response

Every response carries the running statistics (mlx-lm style); a stop string is never emitted,
not even its beginning while it is still undecided. A streamed response is yielded when it has
text, and the last one always (it carries finish_reason): tokens that end inside a UTF-8
character (an emoji spans several byte tokens) or inside a possible stop string only add to the
next response's text.

max_tokens: a count, or None or -1 for "until the context is full"; 0 runs the prompt only.
`token_budget` is the rule, shared by chat(), the CLI, pyklei.chat and pyklei.server; its
type and range are pyklei.sampler's MAX_TOKENS.

A generation owns the model's KV cache while it runs: if another call uses the model between
two of its steps, the next step raises pyklei.model.SequenceLostError rather than continue
somebody else's context.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from .sampler import MAX_TOKENS, SamplingParams, apply_repetition_penalty, make_sampler


@dataclass
class GenerationResponse:
    text: str                        # new text since the last response (streaming) or the whole reply
    token: int | None                # the last token sampled (None: none was)
    finish_reason: str | None        # None while running; "stop" (EOS or stop string) or "length"
    prompt_tokens: int               # tokens in the prompt
    prompt_eval_tokens: int          # of those, tokens that ran (the rest came from the cache)
    generation_tokens: int
    time_to_first_token: float       # seconds from the call to the first sampled token
    prompt_tps: float                # prefill tokens/s
    generation_tps: float            # decode tokens/s (after the first token)
    peak_rss_mb: float
    max_tokens: int = 0              # the token budget it ran with (chat() trims it to the context)


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


def peak_rss_mb() -> float:
    """Peak resident memory of this process. Linux: VmHWM, which starts afresh at exec (the
    rusage figure keeps the parent's peak when a big process spawned this one)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


class StopMatcher:
    """Holds back text that may be the start of a stop string; cuts at the first stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0    # longest suffix of pending that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_generate(model, tokenizer, prompt: Sequence[int], max_tokens: int | None = 256,
                    params: SamplingParams | None = None, stop: Sequence[str] = (),
                    eos_ids: Sequence[int] | None = None,
                    trim: bool = False) -> Iterator[GenerationResponse]:
    """Checks everything before it returns the iterator (errors come at the call, not at the
    first next()); see the module doc for max_tokens and trim."""
    params = params or SamplingParams()
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    budget = token_budget(model.n_ctx, len(prompt), max_tokens, trim=trim)
    return _stream(model, tokenizer, prompt, budget, params, stop, eos_ids)


def _stream(model, tokenizer, prompt, max_tokens, params, stop, eos_ids):
    eos = set(eos_ids if eos_ids is not None else tokenizer.eos_ids)
    sample = make_sampler(params.temperature, params.top_k, params.top_p, params.min_p, params.seed)
    detok = tokenizer.detokenizer()
    matcher = StopMatcher(stop)

    owner = object()   # this generation's claim on the KV cache (model.step checks it)
    t0 = time.perf_counter()
    logits = model.eval(prompt, owner=owner)
    t_prefill = time.perf_counter() - t0
    n_eval = model.last_eval_tokens
    history = list(prompt)
    n_gen, ttft, t_first = 0, 0.0, t0

    rss = [peak_rss_mb(), t0]   # VmHWM read at most every 0.25 s: /proc costs ~0.1 ms per read

    def response(text, token, reason):
        now = time.perf_counter()
        if reason is not None or now - rss[1] > 0.25:
            rss[:] = [peak_rss_mb(), now]
        return GenerationResponse(
            text=text, token=token, finish_reason=reason, prompt_tokens=len(prompt),
            prompt_eval_tokens=n_eval, generation_tokens=n_gen, time_to_first_token=ttft,
            prompt_tps=n_eval / t_prefill if t_prefill > 0 else 0.0,
            generation_tps=(n_gen - 1) / (now - t_first) if n_gen > 1 and now > t_first else 0.0,
            peak_rss_mb=rss[0], max_tokens=max_tokens)

    if max_tokens == 0:
        yield response("", None, "length")
        return
    while True:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty,
                                          params.repetition_window)
        token = sample(logits)
        n_gen += 1
        if n_gen == 1:
            t_first = time.perf_counter()
            ttft = t_first - t0
        if token in eos:
            yield response(matcher.flush() + detok.finalize(), token, "stop")
            return
        history.append(token)
        text, stopped = matcher.feed(detok.add_token(token))
        if stopped:
            yield response(text, token, "stop")
            return
        if n_gen >= max_tokens:
            tail, stopped = matcher.feed(detok.finalize())
            yield response(text + tail + ("" if stopped else matcher.flush()), token,
                           "stop" if stopped else "length")
            return
        if text:
            yield response(text, token, None)
        logits = model.step(token, owner=owner)
