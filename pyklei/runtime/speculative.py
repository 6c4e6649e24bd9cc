"""Speculative decoding: guess the next tokens (from the text so far, or with a small draft
model), check the guess in one pass, keep the agreeing prefix.

    for r in stream_generate(model, tok, ids, max_tokens=300, speculative="lookup"): ...
    llm.generate(prompt, speculative="lookup")        # pyklei generate --lookup
    llm.generate(prompt, speculative=pyklei.load(small))   # --draft-model SMALL.gguf

Why it pays: a pass of k+1 rows of one sequence costs less than k+1 decode steps (the weights
stream once for all rows; benchmarks/results/speculative.md has this machine's costs, and
how they grow with the context, where each row's attention is its own), so when the reply
quotes its input (a summary that quotes, a code edit, a form filled from a document, an answer
from a passage) several tokens come out of one pass.

Drafting by prompt lookup (PromptLookup): the longest n-gram (max_ngram down to min_ngram
tokens) that ends the text so far (prompt and reply) and occurred earlier; the draft is the
tokens that followed that occurrence (for the longest n-grams, the occurrence whose match
reaches furthest back). While a draft keeps being accepted, the next one continues from where
the last one left off in the source (a quote is copied on from the same place).

Drafting by a draft model (DraftModel): a second, smaller pyklei model of the same vocabulary,
in the same process with its own KV cache; before each draft it runs what the target accepted
since (one pass; its cache drops its own rejected tokens by prefix match, Model.eval). Its
logits go through the request's own processing (penalties, logit bias, temperature, top-k/p,
min-p: Generation.draft_token): a greedy request drafts the argmax, a sampling one draws from
that distribution q.

Acceptance, greedy, and prompt lookup: each row of the checking pass goes through the request's
own Generation.feed, with the same penalties, sampler and random stream as plain decoding, and
the draft is accepted while the token sampled from a row equals the drafted token; the first
row that disagrees gives the next token itself. A row's logits are bit for bit those of a
decode step at that position (Model.verify), so the output is token for token plain
decoding's: greedy, and with sampling under the same seed too (every token sampled consumes
the random stream as plain decoding does). Prompt-lookup drafts have no distribution of their
own, so this is the exact rule for them. For a greedy request a draft model's q is one-hot, and
this rule is speculative sampling's (below).

Acceptance, a draft model when sampling: speculative sampling (Generation.feed_drafted,
pyklei.runtime.sampler.speculative_choice): with p the target's processed distribution at a drafted
position, the drafted token x is kept with probability min(1, p(x)/q(x)); at the first
rejection the token is drawn from the normalised residual max(0, p - q); when all are kept, the
last row gives one more from p. The output follows the target's distribution exactly (p and q
are the distributions the samplers draw from, penalties included: the draft's are computed
over the same history), and a sampled draft model keeps far more of its drafts than equality
would. Under a seed the text is repeatable only where the draft lengths are (they follow
measured timings), and it is not plain decoding's text (a draw from the same distribution).
Stop strings, max_tokens, EOS and logprobs go through feed as in plain decoding. A request with
a grammar constraint decodes without speculation (stream_generate's and the engine's choice:
its mask changes with every token, and a draft would need the grammar advanced along it).

Draft length (DraftLength, per request): the k that maximises the expected tokens per pass,
(1 - a^(k+1)) / (1 - a) for a drafted token's acceptance rate a (a running average for each
kind of draft: a prompt-lookup copy in progress, a fresh n-gram match, a draft model's), over the
pass's cost in decode steps (measured per row count: the kernels' cost is not linear in the
rows) plus k * draft_cost (drafting a token; ~0 for lookup, measured for a draft model).
Where no k gains, drafting stops and is probed again after a pause that doubles while probes
fail (one that pays ends it), so a reply that quotes nothing decodes at plain speed. In
pyklei.runtime.engine's batches, a drafted row is priced beside a request's own row in that batch
(PassCost).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Iterator, Sequence

import numpy as np

SPECULATIVE_MODES = ("lookup",)


def check_speculative(speculative, model=None):
    """None (plain decoding), "lookup", or a draft model (a pyklei Model, or an LLM: its model)
    of `model`'s vocabulary that is not `model` itself; anything else is a ValueError at the
    call. Returns None, "lookup" or the draft Model."""
    if speculative is None or speculative is False:
        return None
    if isinstance(speculative, str) and speculative in SPECULATIVE_MODES:
        return speculative
    draft = getattr(speculative, "model", speculative)   # an LLM holds its Model as .model
    if hasattr(draft, "eval") and hasattr(draft, "vocab_size") and hasattr(draft, "n_ctx"):
        draft.check_open()
        if model is not None:
            if draft is model:
                raise ValueError("the draft model is the model itself: load the draft file as "
                                 "a model of its own (its KV cache must be its own)")
            if draft.vocab_size != model.vocab_size:
                raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} tokens, "
                                 f"the model's {model.vocab_size}: a draft model needs the same "
                                 f"vocabulary")
        return draft
    raise ValueError(f"speculative must be None, one of {', '.join(map(repr, SPECULATIVE_MODES))}"
                     f" (prompt lookup) or a draft model (pyklei.load(...)), got {speculative!r}")


def drafting(speculative, prediction, constraint) -> str | None:
    """How a request drafts: None (no speculative and no prediction, or a constraint: its mask
    changes with every token), "lookup" (prompt lookup, over the prediction when there is one:
    a prediction drafts by lookup whatever `speculative` says) or "model" (a draft model)."""
    if constraint is not None or (speculative is None and not prediction):
        return None
    return "lookup" if speculative in (None, "lookup") or prediction else "model"


class PromptLookup:
    """Drafts the continuation of the text's last n-gram from an earlier occurrence.

    index[n] maps an n-gram to the positions of its last token, for occurrences that have a
    next token (so the n-gram ending the text is not its own match); extend() keeps it
    current, in O(max_ngram) per token. Which occurrence: among those of a max_ngram-gram
    (code repeats short patterns), the one whose match with the text's end reaches furthest
    back wins (the latest on a tie): the place the reply is copying from. A shorter n-gram
    (one word, after the reply left its source) is looked for from the cursor on: the place
    in the source where the copy stopped agreeing (a draft's start, moved on by every token
    of the text that equals the source's next one), since a reply that quotes goes forward
    through its source; the latest occurrence when none lies ahead. Filling a form from a
    biography, "... a PhD" + " from" continues from "from Yale" after the cursor, not from
    the latest "from" in the text.

    prediction: token ids of the text the reply is expected to be (OpenAI's predicted outputs),
    drafted from its start while the reply follows it, and a source like the text after."""

    CANDIDATES = 32     # occurrences compared, the latest ones
    REACH = 64          # tokens compared backwards at most

    def __init__(self, tokens: Sequence[int], max_ngram: int = 4, min_ngram: int = 1,
                 prediction: Sequence[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.index: list[dict] = [{} for _ in range(max_ngram + 1)]
        self.source = -1      # the position after the last draft in its source (-1: none)
        self.cursor = -1      # the source position the text is expected to go on from (-1: none)
        # A prediction (OpenAI's predicted outputs: the text the reply is expected to be, such
        # as the file an edit rewrites) goes first in `tokens`, as text that may be copied but
        # is not the model's context; `aligned` follows the reply through it from its start
        # while every token agrees (-1 once one does not: then its n-grams find the way back).
        self.aligned = -1
        self.n_prediction = len(prediction)
        self.extend(prediction)
        self.extend(tokens)
        self.aligned = 0 if self.n_prediction else -1

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        for t in tokens:
            t = int(t)
            if 0 <= self.cursor < len(toks) and toks[self.cursor] == t:
                self.cursor += 1
            if self.aligned >= 0:
                ok = self.aligned < self.n_prediction and toks[self.aligned] == t
                self.aligned = self.aligned + 1 if ok else -1
            toks.append(t)
            j = len(toks) - 2          # the position that just got a next token
            if j == self.n_prediction - 1:   # the prediction's end: the prompt is not its sequel
                continue
            for n in range(self.min_ngram, self.max_ngram + 1):
                if j - n + 1 < 0:
                    break
                self.index[n].setdefault(tuple(toks[j - n + 1:j + 1]), []).append(j)

    def kind(self) -> str:
        """What the next draft would be: "copy" when it goes on with a copy in progress (the
        reply follows the prediction, or the last draft held and its source still agrees with
        the text's end), else "match" (an n-gram looked up afresh). Their drafts hold at very
        different rates: on benchmarks/speculative.py's tasks 90% of a copy's drafted tokens
        against 25-75% of a match's (fewer the shorter the n-gram), so DraftLength keeps a
        rate for each."""
        return "copy" if self._copy_start() >= 0 else "match"

    def _copy_start(self) -> int:
        """Where a copy in progress goes on in `tokens`, or -1. It continues after the token
        that followed the last draft's source (the pass's own token), if the source still
        agrees with the text's last max_ngram tokens."""
        if 0 <= self.aligned < self.n_prediction:   # the reply so far is the prediction's start
            return self.aligned
        toks, m, s = self.tokens, self.max_ngram, self.source + 1
        return s if m <= s < len(toks) and toks[s - m:s] == toks[-m:] else -1

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that may come next (none when no n-gram of the text recurs)."""
        toks = self.tokens
        m = self.max_ngram
        start = self._copy_start()
        if start < 0:
            for n in range(min(m, len(toks)), self.min_ngram - 1, -1):
                ends = self.index[n].get(tuple(toks[-n:]))
                if ends:
                    start = (self._furthest_reach(ends) if n == m else self._ahead(ends)) + 1
                    break
        if start == self.n_prediction > 0:   # a copy of the prediction ran to its end
            start = -1
        if start < 0:
            self.source = -1
            return []
        end = self.n_prediction if start < self.n_prediction else len(toks)   # not past its end
        out = toks[start:min(start + k, end)]
        self.source = start + len(out)
        self.cursor = start
        return out

    def _ahead(self, ends: list[int]) -> int:
        """The first occurrence whose next token is at the cursor or after it, else the
        latest."""
        i = bisect_left(ends, self.cursor - 1) if self.cursor >= 0 else len(ends)
        return ends[i] if i < len(ends) else ends[-1]

    def rejected(self) -> None:
        """The last draft was cut short: the next one looks its source up afresh."""
        self.source = -1

    def _furthest_reach(self, ends: list[int]) -> int:
        """The occurrence (position of its last token) whose match with the text's end goes
        furthest back."""
        toks, end = self.tokens, len(self.tokens) - 1
        best, best_len = ends[-1], -1
        for j in reversed(ends[-self.CANDIDATES:]):
            n = self.max_ngram
            while n < self.REACH and j - n >= 0 and toks[j - n] == toks[end - n]:
                n += 1
            if n > best_len:
                best, best_len = j, n
        return best


class DraftModel:
    """Drafts a draft model's tokens (its own Model: slot 0 of its KV cache holds the text so
    far and its own last draft, which the next eval cuts at the first difference), each from
    its logits processed as the request's (Generation.draft_token): the argmax for a greedy
    request; for a sampling one, a draw from that distribution, which `q` keeps (one row per
    drafted token) for the acceptance rule."""

    def __init__(self, model, tokens: Sequence[int], gen):
        self.model, self.gen = model, gen
        self.tokens = [int(t) for t in tokens]
        self.q: list[np.ndarray] | None = None    # the last draft's distributions (sampling)
        self._owner = object()

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def rejected(self) -> None:
        pass

    def kind(self) -> str:
        return "model"

    def draft(self, k: int) -> list[int]:
        m = self.model
        k = min(k, m.n_ctx - len(self.tokens))    # its context, not the target's, may end first
        if k < 1:
            return []
        logits = m.eval(self.tokens, owner=self._owner)
        out, qs = [], []
        while True:
            token, q = self.gen.draft_token(logits, out)
            out.append(token)
            qs.append(q)
            if len(out) == k:
                break
            logits = m.step(token, owner=self._owner)
        self.q = None if qs[0] is None else qs
        return out


class DraftLength:
    """How many tokens to draft next, from the acceptance rate and the measured cost of a pass.

    accept: running average of the chance that a drafted token is accepted when those before
    it were (each verified position counts once), one for each kind of draft (the drafter's
    kind(): a prompt-lookup copy in progress holds far more often than a fresh match; the
    prior is `accept`, or PRIORS for a kind listed there). The cost of a pass of n rows, in
    decode steps: measured for the row counts that ran (the kernels' cost is not linear in the
    rows), and for the others 1 + row_cost * (n-1),
    row_cost the running average of the measured passes' cost per extra row (prior 0.25, or
    the value set by the caller: pyklei.runtime.engine sets it per batch). draft_cost: the time of
    drafting one token, in decode steps (~0 for lookup; measured for a draft model)."""

    # A copy in progress drafts long from its first draft: 90% of its drafted tokens held on
    # benchmarks/speculative.py's tasks, and from the default prior its drafts took several
    # passes to grow (2, 3, 3, 4, 6, 9, then 16 tokens, filling the form).
    PRIORS = {"copy": 0.9}

    def __init__(self, max_draft: int = 16, accept: float = 0.5, row_cost: float = 0.25,
                 weight: float = 0.15, max_pause: int = 32):
        self.max_draft = max_draft
        self.prior, self.row_cost, self.weight = accept, row_cost, weight
        self.accepts: dict = {}   # kind -> running acceptance rate
        self.draft_cost = 0.0
        self.max_pause = max_pause
        self.pause, self.wait = 0, 0      # steps between probes while off; steps left to wait
        self.seconds: dict[int, float] = {}   # rows -> running average of a pass's seconds

    @property
    def step_s(self) -> float | None:
        return self.seconds.get(1)

    def cost(self, rows: int) -> float:
        """A pass of `rows` rows, in decode steps."""
        t, step = self.seconds.get(rows), self.step_s
        if t is not None and step:
            return t / step
        return 1 + self.row_cost * (rows - 1)

    def accept(self, kind: str | None = None) -> float:
        """The running acceptance rate of a kind of draft."""
        return self.accepts.get(kind, self.PRIORS.get(kind, self.prior))

    def gain(self, k: int, kind: str | None = None) -> float:
        """Expected tokens per pass over its cost in decode steps, drafting k of a kind."""
        a = min(self.accept(kind), 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (self.cost(k + 1) + self.draft_cost * k)

    def length(self, room: int, kind: str | None = None) -> int:
        """The draft length for the next pass (0: take a plain step); room: drafted tokens
        that could still be used; kind: the drafter's kind() of the next draft."""
        limit = min(self.max_draft, room)
        if limit < 1:
            return 0
        if self.wait > 0:
            self.wait -= 1
            return 0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            g = self.gain(k, kind)
            if g > best:
                best_k, best = k, g
        if best_k == 0:
            # off: probe again with one token after a pause that doubles while probes fail
            self.pause = min(max(2 * self.pause, 4), self.max_pause)
            self.wait = self.pause
            return 1
        return best_k

    def accepted(self, drafted: int, n_accepted: int, kind: str | None = None) -> None:
        w, a = self.weight, self.accept(kind)
        for _ in range(n_accepted):
            a += w * (1 - a)
        if n_accepted < drafted:
            a -= w * a
        self.accepts[kind] = a
        if n_accepted:      # a probe that paid: the next one comes without waiting
            self.pause = self.wait = 0

    def timed_step(self, seconds: float) -> None:
        self.timed_pass(1, seconds)

    def timed_draft(self, k: int, seconds: float) -> None:
        if self.step_s is None or k < 1:
            return
        c = seconds / self.step_s / k
        self.draft_cost = c if self.draft_cost == 0 else 0.8 * self.draft_cost + 0.2 * c

    def timed_pass(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if rows > 1 and self.step_s:
            c = (self.seconds[rows] / self.step_s - 1) / (rows - 1)
            self.row_cost = 0.8 * self.row_cost + 0.2 * min(max(c, 0.02), 2.0)


class PassCost:
    """The time of a pass of R rows as fixed + per_row * R, fitted by least squares over the
    recent passes (each older one weighs `decay` less): what pyklei.runtime.engine's requests draft by.
    A drafted row of a request costs per_row; the request's own row, per_row and its share of
    the fixed cost (the weights streamed once for all the batch's requests)."""

    PRIOR_FIXED_ROWS = 3.0   # fixed / per_row before the fit holds (SmolLM2 on one core: ~3-4)

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.sums = [0.0] * 5    # weighted count, R, R^2, T, R*T

    def add(self, rows: int, seconds: float) -> None:
        d = self.decay
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.sums[i] = self.sums[i] * d + v

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None before any pass. Until the row counts have varied
        enough for the fit, per_row is the mean time over the mean rows plus the prior's fixed
        rows."""
        w, x, xx, y, xy = self.sums
        if w <= 0:
            return None
        if w >= 4 and w * xx - x * x > 0.05 * w * w:   # the row counts varied: the fit holds
            per_row = (w * xy - x * y) / (w * xx - x * x)
            fixed = (y - per_row * x) / w
            if per_row > 0:
                return max(fixed, 0.0), per_row
        per_row = y / (x + self.PRIOR_FIXED_ROWS * w)
        return self.PRIOR_FIXED_ROWS * per_row, per_row

    def seconds_per_row(self, requests: int) -> float | None:
        """A request's own row's time in a batch of `requests` (its share of the fixed cost
        included), or None before any pass."""
        f = self.fit()
        return None if f is None else f[1] + f[0] / max(requests, 1)

    def row_cost(self, requests: int) -> float:
        """A drafted row's time over a request's own row's, in a batch of `requests`."""
        f = self.fit()
        fixed_rows = self.PRIOR_FIXED_ROWS if f is None else f[0] / f[1]
        return min(max(1.0 / (fixed_rows / max(requests, 1) + 1.0), 0.02), 2.0)


def stream_speculative(model, prompt: list[int], gen, drafter,
                       policy: DraftLength | None = None) -> Iterator:
    """stream_generate's loop with drafts (see the module doc): `gen` is the request's
    pyklei.runtime.generate.Generation, whose n_drafted / n_accepted count the drafts; `drafter` a
    PromptLookup or DraftModel over the prompt."""
    policy = policy or DraftLength()
    owner = object()   # this generation's claim on slot 0 (as in pyklei.runtime.generate)
    logits = model.eval(prompt, owner=owner)
    gen.prefilled(model.last_eval_tokens)
    if gen.max_tokens == 0:
        yield gen.finish("length")
        return
    rows, draft = [logits], []
    while True:
        # rows[i] predicts the token after draft[:i]; feed them while the draft holds
        q = getattr(drafter, "q", None) if draft else None
        gen.n_drafted += len(draft)
        accepted_before = gen.n_accepted
        out = []
        for i, row in enumerate(rows):
            if i == len(draft):
                r = gen.feed(row)
            elif q is None:
                r = gen.feed(row, draft[i])
            else:
                r = gen.feed_drafted(row, draft[i], q[i])
            if r is not None:
                out.append(r)
            if gen.done:
                break
            drafter.extend([gen.token])
            if i == len(draft) or gen.token != draft[i]:
                break
        if draft:
            n_ok = gen.n_accepted - accepted_before
            policy.accepted(len(draft), n_ok, kind)
            if n_ok < len(draft):
                drafter.rejected()
            # the slot holds the pass's first token and the whole draft: keep the rows that were
            # fed (their tokens are the reply's), as plain decoding leaves the cache
            model.truncate_seq(0, base + 1 + i, owner=owner)
        yield from out
        if gen.done:
            return
        kind = drafter.kind()
        k = policy.length(gen.max_tokens - gen.n_gen - 1, kind)
        t = time.perf_counter()
        draft = drafter.draft(k) if k else []
        if draft:
            policy.timed_draft(len(draft), time.perf_counter() - t)
            t = time.perf_counter()
            base = len(model.seq_tokens(0))
            rows = model.verify([gen.token] + draft, owner=owner)
            policy.timed_pass(len(draft) + 1, time.perf_counter() - t)
        else:
            t = time.perf_counter()
            rows = [model.step(gen.token, owner=owner)]
            policy.timed_step(time.perf_counter() - t)
