"""Streaming generation: prompt tokens in, text pieces out, with stop handling and stats.

    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=64):
        print(r.text, end="")           # r.finish_reason is set on the last response

Every response carries the running statistics (mlx-lm style); a stop string is never emitted,
not even its beginning while it is still undecided. A streamed response is yielded when it has
text, and the last one always (it carries finish_reason): tokens that end inside a UTF-8
character (an emoji spans several byte tokens) or inside a possible stop string only add to the
next response's text. A reply never ends in a partial character: when max_tokens (or EOS) comes
inside one, its bytes are dropped.

max_tokens: a count, or None or -1 for "until the context is full"; 0 runs the prompt only
(pyklei.runtime.request.token_budget is the rule). stream_generate checks its arguments into a
pyklei.runtime.request.GenerationRequest; stream_request runs one made elsewhere (LLM, the server).

A generation owns the model's KV cache while it runs: if another call uses the model between
two of its steps, the next step raises pyklei.runtime.model.SequenceLostError rather than continue
somebody else's context.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .request import GenerationRequest, make_request
from .sampler import (SamplingParams, Sampler, apply_logit_bias, apply_presence_frequency,
                      apply_repetition_penalty, speculative_choice)
from .speculative import (DraftModel, PromptLookup, check_speculative, drafting,
                          stream_speculative)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its raw logits,
    before penalties, bias and temperature, as llm.logits() gives them), and the `top` most
    likely tokens at that position as (id, logprob), most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResponse:
    text: str                        # new text since the last response (streaming) or the whole reply
    token: int | None                # the last token sampled (None: none was)
    finish_reason: str | None        # None while running; "stop" (EOS, stop string, or the
                                     # grammar constraint complete), "length",
                                     # or "cancelled" (pyklei.runtime.engine: RequestStream.cancel)
    prompt_tokens: int               # tokens in the prompt
    prompt_eval_tokens: int          # of those, tokens that ran (the rest came from the cache)
    generation_tokens: int
    time_to_first_token: float       # seconds from the call to the first sampled token
    prompt_tps: float                # prefill tokens/s
    generation_tps: float            # decode tokens/s (after the first token)
    peak_rss_mb: float
    max_tokens: int = 0              # the token budget it ran with (chat() trims it to the context)
    logprobs: list[TokenLogprob] | None = None   # with logprobs asked for: the tokens sampled
                                     # since the last response (an end-of-generation token is not)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # pyklei.runtime.engine's prompt_logprobs:
                                     # on the first response, one per prompt token (the first None)
    tool_calls: list[dict] | None = None   # LLM.chat with tools: the calls parsed from the reply
    reasoning: str | None = None     # LLM.chat of a thinking model: the <think> part (pyklei.text.reasoning),
                                     # kept out of text (streaming: the new reasoning since the last response)
    drafted_tokens: int = 0          # speculative decoding (pyklei.runtime.speculative): tokens drafted
    accepted_tokens: int = 0         # so far, and of those, tokens the model agreed with


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
    """Holds back text that may be the start of a stop string; cuts at the first stop.

    Linear in the text fed, whatever the stop strings' lengths: an Aho-Corasick automaton over
    them, whose state after each character is the longest end of the text so far that begins
    some stop string (what must be held back). Cutting and holding as before it: the cut is
    at the earliest start of any stop found in what was fed (re-finding every held prefix of
    every stop per token made a 480,000-character stop cost 200 ms a token)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        # the trie: state 0 is the root; per state its transitions, failure link, depth, and
        # the lengths of the stops that end there (its own and its failure chain's)
        self._next: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._ends: list[tuple[int, ...]] = [()]
        for stop in self.stops:
            q = 0
            for ch in stop:
                nxt = self._next[q].get(ch)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[q][ch] = nxt
                    self._next.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[q] + 1)
                    self._ends.append(())
                q = nxt
            self._ends[q] = (len(stop),)
        order = list(self._next[0].values())      # breadth first: a state's failure first
        for q in order:
            for ch, nxt in self._next[q].items():
                f = self._fail[q]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                g = self._next[f].get(ch, 0)
                self._fail[nxt] = g if g != nxt else 0
                self._ends[nxt] = self._ends[nxt] + self._ends[self._fail[nxt]]
                order.append(nxt)
        self._state = 0

    def _step(self, ch: str) -> int:
        q = self._state
        while q and ch not in self._next[q]:
            q = self._fail[q]
        self._state = self._next[q].get(ch, 0)
        return self._state

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            out, self.pending = self.pending + text, ""
            return out, False
        base = len(self.pending)
        self.pending += text
        cut = -1
        for i, ch in enumerate(text):
            ends = self._ends[self._step(ch)]
            if ends:
                first = base + i + 1 - max(ends)
                cut = first if cut < 0 else min(cut, first)
        if cut >= 0:
            out, self.pending, self._state = self.pending[:cut], "", 0
            return out, True
        hold = self._depth[self._state]     # a proper prefix of a stop (a whole one was cut)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending, self._state = self.pending, "", 0
        return out


def stream_generate(model, tokenizer, prompt: Sequence[int], max_tokens: int | None = 256,
                    params: SamplingParams | None = None, stop: Sequence[str] = (),
                    eos_ids: Sequence[int] | None = None, trim: bool = False,
                    logprobs: int | None = None, constraint=None,
                    speculative=None, prediction=None) -> Iterator[GenerationResponse]:
    """Checks everything before it returns the iterator (errors come at the call, not at the
    first next()); see the module doc for max_tokens and trim. `constraint`: a fresh
    pyklei.runtime.grammar.Constraint the reply must follow (it ends the reply when complete).
    speculative: None, "lookup" or a draft Model (pyklei.runtime.speculative: the same tokens, in
    fewer passes where the drafts hold); a request with a constraint decodes without it.
    prediction: the text (or token ids) the reply is expected to be, as OpenAI's predicted
    outputs: prompt lookup drafts from it (and from the prompt), whatever `speculative` says."""
    return stream_request(model, tokenizer, make_request(
        model.n_ctx, tokenizer, prompt, max_tokens, params, stop, eos_ids, logprobs, constraint,
        trim, check_speculative(speculative, model), prediction))


def stream_request(model, tokenizer, req: GenerationRequest) -> Iterator[GenerationResponse]:
    """Runs a checked request (pyklei.runtime.request.make_request) on the model's slot 0."""
    if req.constraint is not None:
        req.constraint.claim()
    prompt, gen = list(req.prompt), Generation(tokenizer, req)
    how = drafting(req.speculative, req.prediction, req.constraint)
    if how is not None:
        drafter = (PromptLookup(prompt, prediction=req.prediction) if how == "lookup"
                   else DraftModel(req.speculative, prompt, gen))
        return stream_speculative(model, prompt, gen, drafter)
    return _stream(model, prompt, gen)


def _stream(model, prompt, gen):
    owner = object()   # this generation's claim on the KV cache (model.step checks it)
    logits = model.eval(prompt, owner=owner)
    gen.prefilled(model.last_eval_tokens)
    if gen.max_tokens == 0:
        yield gen.finish("length")
        return
    while True:
        r = gen.feed(logits)
        if r is not None:
            yield r
        if gen.done:
            return
        logits = model.step(gen.token, owner=owner)


class Generation:
    """One request's decoding state, token by token: sampler, repetition history, streaming
    detokenizer, stop strings, an optional grammar constraint, and the statistics of its
    responses. stream_generate drives one over model.eval/step; pyklei.runtime.engine drives many over
    batched steps. The clock starts at construction (t0): time_to_first_token counts from
    there."""

    def __init__(self, tokenizer, req: GenerationRequest, t0: float | None = None):
        """req: the request, checked (pyklei.runtime.request.make_request). Its logprobs: None, or the
        number of most likely alternatives to report beside each generated token's own
        log-probability (GenerationResponse.logprobs); its constraint: a
        pyklei.runtime.grammar.Constraint the reply follows."""
        self.eos = set(req.eos_ids)
        self.constraint = req.constraint  # pyklei.runtime.grammar.Constraint: the tokens allowed next
        self.next_mask = None             # its mask for the next feed, when computed ahead
        self.params = params = req.params
        self.logprobs = req.logprobs
        self._logprobs: list[TokenLogprob] = []     # since the last response
        self.counts: dict[int, int] = {}            # generated tokens (presence/frequency)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None   # set by the engine
        self.sample = Sampler(params)
        self._draft_rng = None            # draws a draft model's tokens (draft_token)
        self.detok = tokenizer.detokenizer()
        self.matcher = StopMatcher(req.stop)
        self.prompt_tokens = len(req.prompt)
        self.max_tokens = req.max_tokens
        self.history = list(req.prompt)
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_prefill = 0.0
        self.n_eval = 0
        self.n_gen, self.ttft, self.t_first = 0, 0.0, self.t0
        self.token: int | None = None      # the last token sampled: the next one to run
        self.done = False
        self.n_drafted = self.n_accepted = 0   # drafted (counted by the drafting loop), accepted
        self._rss = [peak_rss_mb(), self.t0]   # VmHWM read at most every 0.25 s: /proc costs ~0.1 ms per read

    def prefilled(self, n_eval: int, t_start: float | None = None) -> None:
        """The prompt has run (n_eval of its tokens; the rest came from a cache), from t_start
        (default: t0) until now."""
        self.n_eval = n_eval
        self.t_prefill = time.perf_counter() - (self.t0 if t_start is None else t_start)

    def response(self, text: str, token: int | None, reason: str | None) -> GenerationResponse:
        now = time.perf_counter()
        if reason is not None or now - self._rss[1] > 0.25:
            self._rss[:] = [peak_rss_mb(), now]
        n_gen, t_prefill = self.n_gen, self.t_prefill
        return GenerationResponse(
            text=text, token=token, finish_reason=reason, prompt_tokens=self.prompt_tokens,
            prompt_eval_tokens=self.n_eval, generation_tokens=n_gen, time_to_first_token=self.ttft,
            prompt_tps=self.n_eval / t_prefill if t_prefill > 0 else 0.0,
            generation_tps=(n_gen - 1) / (now - self.t_first) if n_gen > 1 and now > self.t_first else 0.0,
            peak_rss_mb=self._rss[0], max_tokens=self.max_tokens, logprobs=self._take_logprobs(),
            prompt_logprobs=self._take_prompt_logprobs(), drafted_tokens=self.n_drafted,
            accepted_tokens=self.n_accepted)

    def _take_prompt_logprobs(self):
        out, self.prompt_logprobs = self.prompt_logprobs, None
        return out

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        out, self._logprobs = self._logprobs, []
        return out

    def _note_logprob(self, logits: np.ndarray, token: int) -> None:
        self._logprobs.append(token_logprob(logits, token, self.logprobs))


    def finish(self, reason: str) -> GenerationResponse:
        """Ends the generation without sampling (max_tokens 0: "length"; "cancelled"); text held
        back for a possible stop string is dropped."""
        self.done = True
        return self.response("", self.token, reason)

    def feed(self, logits: np.ndarray, drafted: int | None = None) -> GenerationResponse | None:
        """Samples the next token from `logits`; returns the response to yield (None when this
        token adds no text yet). Sets `done` on the last one, else `token` is the next to run.
        drafted: the token a draft put at this position (speculative decoding: it counts in
        n_accepted when the token sampled equals it)."""
        token = self.sample(self.process(logits))
        if self.constraint is not None and token not in self.eos:   # never cut an unclosed reply
            token = self.constraint.fit_budget(token, self.max_tokens - self.n_gen - 1)
        return self._take(token, logits, drafted)

    def process(self, logits: np.ndarray, drafted: Sequence[int] = ()) -> np.ndarray:
        """The logits the sampler draws from: penalties over the tokens so far (and `drafted`,
        tokens that would follow them: a draft model's distribution at a drafted position),
        logit bias, and the grammar mask (which only feed uses: drafting is off with one)."""
        p = self.params
        history, counts = self.history, self.counts
        if drafted:
            history = history + list(drafted)
            counts = dict(counts)
            for t in drafted:
                counts[t] = counts.get(t, 0) + 1
        logits = apply_repetition_penalty(logits, history, p.repetition_penalty,
                                          p.repetition_window)
        logits = apply_presence_frequency(logits, counts, p.presence_penalty,
                                          p.frequency_penalty)
        logits = apply_logit_bias(logits, p.logit_bias)
        if self.constraint is not None:   # forbidden tokens -> -inf; EOS only where it accepts
            logits = self.constraint.apply(logits, self.eos, self.next_mask)
            self.next_mask = None
        return logits

    # ---- speculative decoding with a draft model (pyklei.runtime.speculative) ----------------------
    def draft_token(self, draft_logits: np.ndarray,
                    drafted: Sequence[int]) -> tuple[int, np.ndarray | None]:
        """A draft model's token after the tokens so far and `drafted`, from its logits
        processed as the request's own (so its guesses follow the same penalties and bias), and
        the distribution q it was drawn from: greedy requests take the argmax (q None: the
        draft is checked by equality, exact for greedy); sampling ones draw from q with a
        generator of their own (derived from the seed), for feed_drafted's rule."""
        logits = self.process(draft_logits, drafted)
        if self.sample.greedy:
            return self.sample(logits), None
        q = self.sample.probs(logits)
        if self._draft_rng is None:
            self._draft_rng = self.sample.rng.spawn(1)[0]   # leaves the request's stream as is
        ids = np.flatnonzero(q)
        return int(ids[self._draft_rng.choice(ids.size, p=q[ids])]), q

    def feed_drafted(self, logits: np.ndarray, token: int,
                     q: np.ndarray) -> GenerationResponse | None:
        """feed() for the row that checks drafted `token`, drawn from distribution q (by
        draft_token): speculative sampling's rule (pyklei.runtime.sampler.speculative_choice), so the
        token that comes out follows the target's own distribution exactly. The token differs
        from `token` when the draft is rejected."""
        p = self.sample.probs(self.process(logits))
        return self._take(speculative_choice(p, q, token, self.sample.rng), logits, token)

    def _take(self, token: int, raw: np.ndarray, drafted: int | None) -> GenerationResponse | None:
        """The sampled token joins the reply (raw: its row's logits, for logprobs; drafted: see
        feed). n_accepted is counted first, so that the response carries it."""
        self.token = token
        self.n_accepted += token == drafted
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.logprobs is not None and token not in self.eos:
            self._note_logprob(raw, token)
        self.n_gen += 1
        if self.n_gen == 1:
            self.t_first = time.perf_counter()
            self.ttft = self.t_first - self.t0
        if token in self.eos:
            self.done = True
            # The reply ends here: bytes of a character no token will complete are dropped, not
            # shown as U+FFFD (the same below when max_tokens cuts inside an emoji).
            return self.response(self.matcher.flush() + self.detok.finalize(drop_incomplete=True),
                                 token, "stop")
        self.history.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        text, stopped = self.matcher.feed(self.detok.add_token(token))
        if stopped:
            self.done = True
            return self.response(text, token, "stop")
        # a grammar that can take no more text ends the reply as EOS would
        complete = self.constraint is not None and self.constraint.is_done()
        if self.n_gen >= self.max_tokens or complete:
            tail, stopped = self.matcher.feed(self.detok.finalize(drop_incomplete=True))
            self.done = True
            return self.response(text + tail + ("" if stopped else self.matcher.flush()), token,
                                 "stop" if stopped or complete else "length")
        return self.response(text, token, None) if text else None


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """The token's log-softmax under the raw logits, and the n_top most likely tokens."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top = ()
    if n_top:
        idx = np.argpartition(-x, n_top - 1)[:n_top]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(token, float(x[token] - lse), top)
