"""Streaming generation: prompt tokens in, text pieces out, with stop handling and stats.

    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=64):
        print(r.text, end="")           # r.finish_reason is set on the last response

Every response carries the running statistics (mlx-lm style); a stop string is never emitted,
not even its beginning while it is still undecided.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from .sampler import SamplingParams, apply_repetition_penalty, make_sampler


@dataclass
class GenerationResponse:
    text: str                        # new text of this step (streaming) or the whole reply
    token: int | None                # the token sampled at this step (None: final flush)
    finish_reason: str | None        # None while running; "stop" (EOS or stop string) or "length"
    prompt_tokens: int               # tokens in the prompt
    prompt_eval_tokens: int          # of those, tokens that ran (the rest came from the cache)
    generation_tokens: int
    time_to_first_token: float       # seconds from the call to the first sampled token
    prompt_tps: float                # prefill tokens/s
    generation_tps: float            # decode tokens/s (after the first token)
    peak_rss_mb: float


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


def stream_generate(model, tokenizer, prompt: Sequence[int], max_tokens: int = 256,
                    params: SamplingParams | None = None, stop: Sequence[str] = (),
                    eos_ids: Sequence[int] | None = None) -> Iterator[GenerationResponse]:
    params = params or SamplingParams()
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + max_tokens > model.n_ctx:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                         f"context of {model.n_ctx} tokens; shorten the prompt, lower max_tokens "
                         f"or load with a larger n_ctx")
    eos = set(eos_ids if eos_ids is not None else tokenizer.eos_ids)
    sample = make_sampler(params.temperature, params.top_k, params.top_p, params.min_p, params.seed)
    detok = tokenizer.detokenizer()
    matcher = StopMatcher(stop)

    t0 = time.perf_counter()
    logits = model.eval(prompt)
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
            peak_rss_mb=rss[0])

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
        yield response(text, token, None)
        logits = model.step(token)
