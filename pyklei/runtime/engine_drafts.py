"""The engine's speculative drafts, step by step: a request's draft by prompt lookup, and the
drafts of the requests that draft with the engine's draft model, in that model's batched passes
before the step (pyklei.runtime.engine).

submit(speculative="lookup"), or Engine(speculative="lookup") for every request, drafts by prompt lookup;
Engine(speculative=draft_model) drafts with a draft model (a second Model of the same
vocabulary with at least n_parallel slots: slot s of its KV cache drafts for the request in
slot s of the model). A request's draft runs as more rows of its slot in the same batch; its
rows are fed in order while the draft holds (greedy: the same tokens as without drafts; a
sampled draft model's tokens by speculative sampling's rule, Generation.feed_drafted), and the
slot drops the rejected tail. The draft model's passes come before the step: the first runs,
for every request drafting with it, the tokens its slot lacks (what was accepted since its last
draft, or a chunk of the prompt; from the first position where its slot differs from the
request's text, which drops its own rejected drafts), then one pass per further drafted token,
each with a row per request still drafting. A request's draft length adapts to its own
acceptance rate and to what a drafted row costs beside a request's own row in this batch
(pyklei.runtime.speculative.PassCost, fitted over the decode steps' times: in a big batch the weights
are already shared, and a drafted row costs nearly what a request's own row does), and what
drafting a token costs (the draft model's passes, fitted the same way). A constrained request
decodes without drafts.

A request here is the engine's record of one (engine._Request): its Generation (gen), its
slot, its drafter (lookup) or draft model flag, its DraftLength, and this step's draft and
distributions (draft, q), which these functions fill.
"""
from __future__ import annotations

import time

import numpy as np


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix, by bisection over slice comparisons (C loops:
    the draft model's slots are compared with their requests' text every step)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:     # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def lookup_draft(r, row_cost: float, budget: int) -> list[int]:
    """r's draft by prompt lookup for this step (at most `budget` tokens): none without it,
    or when it does not pay."""
    if r.lookup is None or r.stream.cancelled or budget < 1:
        return []
    r.draft_length.row_cost = row_cost
    r.draft_kind = r.lookup.kind()
    k = min(r.draft_length.length(r.gen.max_tokens - r.gen.n_gen - 1, r.draft_kind), budget)
    return r.lookup.draft(k) if k else []


def model_drafts(dm, reqs: list, n_decoding: int, row_cost: float, draft_rows: int, *,
                 prefill_chunk: int, pass_cost, draft_pass_cost) -> None:
    """The drafts of `reqs` (requests drafting with the draft model dm) for this step, in the
    draft model's batched passes (module doc): r.draft, and r.q for a sampling one;
    `draft_rows` drafted tokens at most over all of them.
    n_decoding: the requests decoding in this step (what a request's own row costs);
    pass_cost, draft_pass_cost: the engine's PassCost of its model's and of dm's passes;
    prefill_chunk: the rows a step gives a catch-up at most."""
    tokens, seqs, pos, rows, drafting = [], [], [], [], []
    own_row = pass_cost.seconds_per_row(n_decoding)
    drafted_row = draft_pass_cost.seconds_per_row(len(reqs))
    starts = {}
    for r in reqs:
        text = r.gen.history          # the prompt and the reply so far (gen.token last)
        if len(text) < dm.n_ctx:      # its context, not the model's, may end first
            start = min(common_prefix(dm.seq_tokens(r.slot), text), len(text) - 1)
            starts[r] = dm.reusable_prefix(r.slot, start)
    # A long catch-up (a new request's prompt) goes in chunks, prefill_chunk rows a step for
    # all of them, as the model's own prefill does; the requests that lack a few tokens
    # (their last step's) come first, so that they draft in every step.
    budget = prefill_chunk
    for r in sorted(starts, key=lambda r: len(r.gen.history) - starts[r]):
        text, start = r.gen.history, starts[r]
        end = min(len(text), start + max(budget, 0))
        budget -= end - start
        k = 0
        if end == len(text):
            r.draft_length.row_cost = row_cost
            r.draft_length.draft_cost = (drafted_row / own_row if drafted_row and own_row
                                         else 0.0)
            r.draft_kind = "model"
            k = max(min(r.draft_length.length(r.gen.max_tokens - r.gen.n_gen - 1,
                                              r.draft_kind),
                        dm.n_ctx - len(text), draft_rows), 0)
            draft_rows -= k
        if end < len(text) or k > 0:
            tokens += text[start:end]
            seqs += [r.slot] * (end - start)
            pos += range(start, end)
        if k > 0:
            rows.append(len(tokens) - 1)
            drafting.append((r, k))
            r.q = []
    while tokens:
        t = time.perf_counter()
        logits = dm.batch(np.array(tokens, np.int32), np.array(seqs, np.int32),
                          np.array(pos, np.int32), np.array(rows, np.int32))
        draft_pass_cost.add(len(tokens), time.perf_counter() - t)
        going = []
        for (r, k), row in zip(drafting, logits):
            try:
                token, q = r.gen.draft_token(row, r.draft)
            except Exception:   # a draft is only a guess: the request's own row decides
                continue        # (and reports the failure, if it is one there too)
            r.draft.append(token)
            r.q.append(q)
            if len(r.draft) < k:
                going.append((r, k))
        drafting = going
        tokens = [r.draft[-1] for r, _ in drafting]
        seqs = [r.slot for r, _ in drafting]
        pos = [len(r.gen.history) + len(r.draft) - 1 for r, _ in drafting]
        rows = list(range(len(drafting)))
    for r in reqs:
        if r.q is not None and (not r.q or r.q[0] is None):
            r.q = None            # greedy drafts are checked by equality (Generation.feed)
