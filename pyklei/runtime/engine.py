"""Continuous batching: many generation requests on one Model, decoded together.

    engine = Engine(Model("smollm2.gguf", n_seq=4), tokenizer, n_parallel=4)
    stream = engine.submit(prompt_ids, max_tokens=64, params=SamplingParams(temperature=0))
    for r in stream:                       # GenerationResponse, as stream_generate yields them
        print(r.text, end="")
    engine.shutdown()

A scheduler thread owns the model. Each request gets a KV cache slot (slots [0, n_parallel) of
the model's n_seq). Every step runs, in one Model.batch call, the next token of every running
request plus one chunk (prefill_chunk tokens) of at most one prompt still being prefilled: the
weights stream once for all of them, a newcomer's prompt neither stalls the running requests
(it goes in chunks) nor waits for them to end. A request that finishes or is cancelled frees its
slot at once. Requests beyond n_parallel wait in a queue of at most max_queue (QueueFullError).

Failure: a model step that fails fails the requests of that step; a request whose own sampling
or decoding fails (RequestFailedError) ends alone, and the others in its batch go on.

Determinism: a row of a batch gets the same logits, bit for bit, as alone (Model.batch), and each
request samples with its own sampler (its own seed), so a request's text does not depend on
what else runs.

Constrained requests (submit(constraint=), pyklei.runtime.grammar): each step, the grammar masks of the
requests that sample in it are computed on a helper thread while model.batch runs (both release
the GIL), and applied to their logits after it.

Speculative decoding (pyklei.runtime.speculative): submit(speculative="lookup") drafts by prompt
lookup, Engine(speculative=draft_model) with a draft model of n_parallel slots; a request's
draft runs as more rows of its slot in the same batch and is fed while it holds (greedy: the
same tokens as without drafts). engine_drafts' module doc tells the whole of it.

Prefix reuse: a slot keeps its tokens after its request ends. A new request goes to the free
slot sharing the longest prefix with its prompt, or, when another slot (running or idle) shares
a longer one, gets that prefix copied (Model.copy_seq); when the prefix cache
(pyklei.runtime.prefix_cache: Engine(cache_ram=MB), the whole blocks of ended requests, kept
beyond their slots) holds a longer one still, its blocks are written into the slot. Only the
rest of the prompt runs (prompt_eval_tokens says how many did). Only slots and blocks of the
same cache partition count (submit(cache_partition=): a server's tenant, an API key and a
cache_salt): how much of a prompt was cached, and how fast its first token came, would
otherwise tell one user what another's prompt holds.

Fairness: a request's choices (submit_choices, OpenAI's n) share one request's turn. When a
slot frees, the waiting request whose submission has the fewest running choices takes it, then
the one whose submission was served least (first come first among equals): submissions take
turns, so a request of n=16 cannot hold every slot while a newcomer waits. Drafted rows
(speculative decoding) are bounded per step (MAX_DRAFT_ROWS), so that drafting requests cannot
make every step long for the others; so are the rows of a prompt whose every position's
log-probabilities are wanted (PROMPT_LOGPROBS_SHARED, while others decode).

The engine owns its model: a call on the model from elsewhere while the engine runs (a
generate(), logits()) makes the engine's step fail with "model is busy", and the requests of
that step raise that error from their streams; the engine goes on with the next requests.

Embeddings (embed(), pyklei.runtime.embedding): an embedding request runs on the model's KV cache
slots beyond n_parallel (serve loads n_parallel + EMBEDDING_SLOTS), which no generation uses, in
passes of at most prefill_chunk rows between the generation steps, as a prompt's chunks do: a
generation's tokens are the same with or without embeddings beside it, and its pace drops by
at most one such pass per step while they run.

Timing per response, as stream_generate's: time_to_first_token from submit() (queueing
included); prompt_tps over the prompt's prefill, from its first chunk to its last (steps of the
other requests included: that is the time it took).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .generate import Generation, GenerationResponse, token_logprob
from .request import GenerationRequest, check_params, make_request
from .request_stream import RequestStream
from .embedding import EmbeddingBatch
from .engine_drafts import common_prefix, lookup_draft, model_drafts
from .model import Model
from .options import ENGINE_OPTION, check_options, default
from .prefix_cache import engine_cache
from .sampler import SamplingParams
from .speculative import DraftLength, PassCost, PromptLookup, check_speculative, drafting


#: KV cache slots a server's model has beyond its parallel sequences, for embeddings (a slot costs
#: memory only for the positions it has held: pyklei.runtime.model)
EMBEDDING_SLOTS = 2


class QueueFullError(RuntimeError):
    """submit() while max_queue requests are already waiting for a slot."""


class EngineClosedError(RuntimeError):
    """submit() after shutdown()."""


class RequestFailedError(RuntimeError):
    """One request failed while its token was sampled or its text decoded (non-finite logits,
    a sampler or detokenizer error): raised from that request's stream only; the requests
    beside it in the batch go on. The original exception is its __cause__."""


class _Submission:
    """What the requests of one submit call share: their turn (module doc: fairness)."""
    __slots__ = ("served",)

    def __init__(self):
        self.served = 0            # of its requests, how many were given a slot so far

#: Drafted rows one step verifies at most, over all its requests: a request's drafts cost its
#: neighbours a row each (~1 ms for SmolLM2 at depth 600), and three requests drafting 16 rows
#: each slowed a plain stream beside them from 147 to 10 tok/s.
MAX_DRAFT_ROWS = 16
#: Prompt rows per step when every prompt position's log-probabilities are wanted (echo with
#: logprobs), alone and beside requests that decode. Each such row is a row of prefill
#: (SmolLM2: ~1.5 ms, a decode step ~5) plus a whole vocabulary's logits scored on this thread
#: (~0.8 ms for 49k): a 3,900-token prompt in 256-row chunks slowed a stream beside it from
#: 201 to 1.6 tok/s; 4 rows a step keep such a stream above half its pace.
PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_SHARED = 64, 2


class _Request:
    __slots__ = ("stream", "prompt", "gen", "slot", "done_pos", "n_reused", "t_prefill", "failed",
                 "after", "prefill_over", "lookup", "draft_model", "draft_length", "draft", "q",
                 "draft_kind", "partition", "submission")

    def __init__(self, stream: RequestStream, prompt: list[int], gen: Generation,
                 after: "_Request | None" = None, partition=None,
                 submission: "_Submission | None" = None):
        self.stream, self.prompt, self.gen = stream, prompt, gen
        self.after = after         # the request whose prompt evaluation this one waits for
        self.partition = partition   # its cache partition: it reuses only that one's prefixes
        self.submission = submission or _Submission()   # its submit call's shared turn
        self.prefill_over = False  # its prompt is in its slot, or it ended: `after`s may start
        self.slot = -1
        self.done_pos = 0          # positions of the slot written for this request so far
        self.n_reused = 0          # prompt tokens that came from a cache
        self.t_prefill = None      # when its first prefill chunk ran
        self.failed = False        # ended by RequestFailedError
        self.lookup: PromptLookup | None = None   # speculative="lookup": its drafter,
        self.draft_model = False                  # or it drafts with the engine's draft model;
        self.draft_length: DraftLength | None = None   # its draft length,
        self.draft: list[int] = []                # the draft of the current step,
        self.q: list | None = None                # and its distributions (a sampled draft model)
        self.draft_kind: str | None = None        # its kind (PromptLookup.kind, or "model")


class Engine:
    def __init__(self, model: Model, tokenizer, *,
                 n_parallel: int = default(ENGINE_OPTION, "n_parallel"),
                 max_queue: int = default(ENGINE_OPTION, "max_queue"),
                 prefill_chunk: int = default(ENGINE_OPTION, "prefill_chunk"), speculative=None,
                 cache_ram: int = default(ENGINE_OPTION, "cache_ram"), cache_dir=None,
                 cache_disk: int = default(ENGINE_OPTION, "cache_disk")):
        """cache_ram (MB, 0: off), cache_dir, cache_disk (MB): the prefix cache (module doc)."""
        check_options(ENGINE_OPTION, n_parallel=n_parallel, max_queue=max_queue,
                      prefill_chunk=prefill_chunk, cache_ram=cache_ram, cache_disk=cache_disk)
        model.check_open()
        if n_parallel > model.n_seq:
            raise ValueError(f"n_parallel={n_parallel} needs as many KV cache slots; the model has "
                             f"n_seq={model.n_seq} (load it with Model(..., n_seq={n_parallel}))")
        self.draft_model = None
        mode = check_speculative(speculative, model)
        if mode is not None and mode != "lookup":
            if mode.n_seq < n_parallel:
                raise ValueError(f"the draft model drafts for {n_parallel} parallel sequences and "
                                 f"needs as many KV cache slots; it has n_seq={mode.n_seq} (load "
                                 f"it with n_seq={n_parallel})")
            self.draft_model = mode
        self.speculative = mode                   # submit's default
        self.model, self.tokenizer = model, tokenizer
        self.prefix_cache = engine_cache(model, cache_ram, cache_dir, cache_disk)
        self._ended: list[_Request] = []          # ended requests whose blocks are not saved yet
        self.n_parallel, self.max_queue, self.prefill_chunk = n_parallel, max_queue, prefill_chunk
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []        # in admission order (prefill goes FIFO)
        self._embeds: deque[tuple[EmbeddingBatch, Future]] = deque()   # FIFO, one at a time
        self._last_used = [0] * n_parallel        # step of each slot's last use (LRU on ties)
        self._partition = [None] * n_parallel     # the cache partition of each slot's tokens
        self._step = 0
        self._closing = False
        self._mask_pool: ThreadPoolExecutor | None = None   # grammar masks during model.batch
        self._pass_cost = PassCost()              # decode steps' times: what drafts cost
        self._draft_pass_cost = PassCost()        # the draft model's passes' times
        self._counts = dict(completed=0, cancelled=0, failed=0, generated_tokens=0, prompt_tokens=0,
                            prompt_eval_tokens=0, drafted_tokens=0, accepted_tokens=0,
                            prefix_cache_queries=0, prefix_cache_hits=0)
        self._thread = threading.Thread(target=self._loop, name="pyklei-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side ---------------------------------------------------------------
    def submit(self, prompt: Sequence[int], *, max_tokens: int | None = 256,
               params: SamplingParams | None = None, stop: Sequence[str] = (),
               eos_ids: Sequence[int] | None = None, trim: bool = False,
               logprobs: int | None = None, constraint=None,
               speculative=None, prediction=None, cache_partition=None) -> RequestStream:
        """Queues a generation; checks it at the call as stream_generate does (ValueError,
        TypeError). QueueFullError when max_queue requests wait, EngineClosedError after
        shutdown(). logprobs: see Generation. `constraint`: a fresh pyklei.runtime.grammar.Constraint
        the reply follows. speculative: "lookup", the engine's draft model (see the module
        doc), or None: the engine's default (Engine(speculative=)). prediction: the reply's
        expected text or token ids (OpenAI's predicted outputs): prompt lookup drafts from it.
        cache_partition: any hashable; the request reuses cached prefixes of requests of the
        same partition only (module doc; None is a partition too)."""
        return self.submit_choices(prompt, [params], max_tokens=max_tokens, stop=stop,
                                   eos_ids=eos_ids, trim=trim, logprobs=logprobs,
                                   constraint=constraint, speculative=speculative,
                                   prediction=prediction, cache_partition=cache_partition)[0]

    def submit_choices(self, prompt: Sequence[int], params: Sequence[SamplingParams | None], *,
                       max_tokens: int | None = 256, stop: Sequence[str] = (),
                       eos_ids: Sequence[int] | None = None, trim: bool = False,
                       logprobs: int | None = None, prompt_logprobs: bool = False,
                       constraint=None, speculative=None,
                       prediction=None, cache_partition=None) -> list[RequestStream]:
        """Several generations of one prompt (OpenAI's n), one per SamplingParams (give each its
        own seed); see submit_requests. constraint: the first choice follows it, each other
        choice a fresh copy of it."""
        if self._closing:
            raise EngineClosedError("the engine is shut down")
        mode = self._check_speculative(speculative) or self.speculative
        if not params:
            raise ValueError("submit_choices needs at least one SamplingParams")
        first = make_request(self.model.n_ctx, self.tokenizer, prompt, max_tokens, params[0],
                             stop, eos_ids, logprobs, constraint, trim, mode, prediction)
        vocab = self.tokenizer.vocab_size
        reqs = [first] + [dataclasses.replace(first, params=check_params(p, vocab),
                                              constraint=None if constraint is None
                                              else constraint.fresh())
                          for p in params[1:]]
        return self.submit_requests(reqs, prompt_logprobs=prompt_logprobs,
                                    cache_partition=cache_partition)

    def submit_requests(self, reqs: Sequence[GenerationRequest], *,
                        prompt_logprobs: bool = False,
                        cache_partition=None) -> list[RequestStream]:
        """Queues checked requests (pyklei.runtime.request.make_request) that share one prompt: the
        prompt is evaluated once, by the first; the others wait until it is in the first's KV
        cache slot, then start from a copy of it (Model.copy_seq) and run only its last token.
        All are queued, or none (QueueFullError). prompt_logprobs: the first request's first
        response carries the log-probability of every prompt token (the whole prompt runs: no
        cached prefix is reused), with its `logprobs` alternatives each. cache_partition: see
        submit()."""
        hash(cache_partition)     # TypeError now, not in the scheduler
        if self._closing:
            raise EngineClosedError("the engine is shut down")
        if not reqs:
            raise ValueError("submit_requests needs at least one request")
        if any(r.prompt != reqs[0].prompt for r in reqs):
            raise ValueError("the requests of one submit_requests call share one prompt")
        for r in reqs:   # the one check of a trusted request: it was made for this context
            if len(r.prompt) + r.max_tokens > self.model.n_ctx:
                raise ValueError(f"a request of {len(r.prompt)} prompt tokens and a budget of "
                                 f"{r.max_tokens} does not fit this engine's context of "
                                 f"{self.model.n_ctx} tokens")
        modes = [self._check_speculative(r.speculative) or self.speculative for r in reqs]
        queued = []
        submission = _Submission()
        for req, mode in zip(reqs, modes):
            ids = list(req.prompt)
            r = _Request(RequestStream(self, len(ids)), ids, Generation(self.tokenizer, req),
                         after=queued[0] if queued else None, partition=cache_partition,
                         submission=submission)
            how = drafting(mode, req.prediction, req.constraint)
            if how is not None:
                r.draft_length = DraftLength()
                if how == "lookup":
                    r.lookup = PromptLookup(ids, prediction=req.prediction)
                else:
                    r.draft_model = True
            queued.append(r)
        if prompt_logprobs:
            queued[0].gen.prompt_logprobs = [None]
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            if len(self._waiting) + len(queued) > self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting "
                                     f"(max_queue={self.max_queue})")
            for r in queued:   # here: a refused request leaves its constraint unused
                if r.gen.constraint is not None:
                    r.gen.constraint.claim()
            self._waiting.extend(queued)
            self._cond.notify_all()
        return [r.stream for r in queued]

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str) -> Future:
        """Queues the embedding of token lists (module doc: embeddings); returns a Future of
        their pooled hidden states, float64 [len(inputs), n_embd] (EmbeddingBatch.pooled: not
        yet cut or normalised; pyklei.runtime.embedding.finish does that). cancel() on the Future
        drops what is left of it. ValueError for an empty input, one longer than n_ctx, or a
        model without KV cache slots beyond n_parallel; QueueFullError, EngineClosedError as
        submit."""
        if self.model.n_seq <= self.n_parallel:
            raise ValueError(f"embeddings run on KV cache slots beyond the engine's n_parallel="
                             f"{self.n_parallel}; the model has n_seq={self.model.n_seq} (load it "
                             f"with n_seq={self.n_parallel + EMBEDDING_SLOTS})")
        for i, x in enumerate(inputs):
            if len(x) > self.model.n_ctx:
                raise ValueError(f"input {i} has {len(x)} tokens, more than the context of "
                                 f"{self.model.n_ctx}")
        job = (EmbeddingBatch(inputs, pooling), Future())
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            if len(self._embeds) >= self.max_queue:
                raise QueueFullError(f"{len(self._embeds)} embedding requests are already waiting "
                                     f"(max_queue={self.max_queue})")
            self._embeds.append(job)
            self._cond.notify_all()
        return job[1]

    def _embed_pass(self) -> None:
        """Runs one pass of the first embedding request not cancelled; a failure is its alone."""
        with self._cond:
            while self._embeds and self._embeds[0][1].cancelled():
                self._embeds.popleft()
            if not self._embeds:
                return
            batch, fut = self._embeds[0]
        try:
            done = batch.step(self.model, range(self.n_parallel, self.model.n_seq),
                              self.prefill_chunk)
            result = batch.pooled() if done else None
        except Exception as e:
            done, result = True, e
        if not done:
            return
        with self._cond:
            self._embeds.popleft()
        try:
            fut.set_exception(result) if isinstance(result, Exception) else fut.set_result(result)
        except InvalidStateError:      # cancelled meanwhile
            pass

    def _check_speculative(self, speculative):
        mode = check_speculative(speculative, self.model)
        if mode is not None and mode != "lookup" and mode is not self.draft_model:
            raise ValueError("a request drafts by prompt lookup ('lookup') or with the engine's "
                             "own draft model (Engine(speculative=draft_model)), which has a "
                             "KV cache slot per parallel sequence; this draft model is not it")
        return mode

    def has_room(self, n: int = 1) -> bool:
        """Whether n more requests would fit the queue now (a server asks before the costly
        part of parsing a request; submit still decides)."""
        with self._cond:
            return not self._closing and len(self._waiting) + n <= self.max_queue

    @property
    def n_ctx(self) -> int:
        """A request's context in tokens (prompt + generated): the model's n_ctx, per slot."""
        return self.model.n_ctx

    @property
    def scheduler_alive(self) -> bool:
        """Whether the scheduler thread still runs (a server's health check reads it)."""
        return self._thread.is_alive()

    def stats(self) -> dict:
        pc = self.prefix_cache
        with self._cond:
            return dict(queued=len(self._waiting), running=len(self._running),
                        n_parallel=self.n_parallel, kv_capacity_tokens=self.n_parallel * self.n_ctx,
                        kv_used_tokens=sum(r.done_pos for r in self._running),
                        prefix_cache_bytes=pc.ram_used if pc else 0,
                        prefix_cache_capacity_bytes=pc.ram_bytes if pc else 0,
                        prefix_cache_restored=pc.counts["restored_tokens"] if pc else 0, **self._counts)

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stops accepting requests; finishes the running and queued ones (cancel=False) or
        cancels them all, then ends the scheduler thread (waiting at most `timeout` seconds).
        Idempotent."""
        with self._cond:
            self._closing = True
            if cancel:
                for r in itertools.chain(self._waiting, self._running):
                    r.stream.cancelled = True
                for _, fut in self._embeds:
                    try:
                        fut.set_exception(EngineClosedError("the engine is shut down"))
                    except InvalidStateError:      # cancelled already
                        pass
                self._embeds.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> bool:
        self.shutdown(cancel=exc[0] is not None)
        return False

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- the scheduler thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._embeds or self._closing):
                    self._cond.wait()
                self._drop_cancelled()
                if self._closing and not self._waiting and not self._running and not self._embeds:
                    if self._mask_pool is not None:
                        self._mask_pool.shutdown()
                    self._save_ended()
                    if self.prefix_cache is not None:
                        self.prefix_cache.close()
                    return
                admitted = []
                while len(self._running) < self.n_parallel:
                    r = self._next_admitted()
                    if r is None:
                        break
                    self._waiting.remove(r)
                    self._running.append(r)
                    admitted.append(r)
                    self._counts["prompt_tokens"] += len(r.prompt)
            try:
                self._save_ended()        # before a slot they held is given to another
                for r in admitted:
                    self._place(r)
                self._run_step()
            except BaseException as e:   # the model failed: the running requests get the error
                with self._cond:
                    failed, self._running = self._running, []
                for r in failed:
                    r.prefill_over = True
                    r.stream._put(e)
            self._embed_pass()

    def _next_admitted(self) -> "_Request | None":
        """(lock held) The waiting request to run next (module doc: fairness): the first queued
        of those whose submission has the fewest requests running, then was served least; a
        choice of n waits for the first choice's prompt evaluation."""
        running: dict[_Submission, int] = {}
        for r in self._running:
            running[r.submission] = running.get(r.submission, 0) + 1
        best, best_key = None, None
        for r in self._waiting:
            if r.after is not None and not r.after.prefill_over:
                continue
            key = (running.get(r.submission, 0), r.submission.served)
            if best is None or key < best_key:
                best, best_key = r, key
        if best is not None:
            best.submission.served += 1
        return best

    def _drop_cancelled(self) -> None:
        """(lock held) Ends the cancelled requests, queued or running: their slots are free."""
        for q in (self._waiting, self._running):
            for r in [r for r in q if r.stream.cancelled]:
                q.remove(r)
                r.prefill_over = True
                self._ended.append(r)
                self._counts["cancelled"] += 1
                self._count_tokens(r)
                r.stream._put(r.gen.finish("cancelled"))

    def _count_tokens(self, r: _Request) -> None:
        """(lock held) Adds an ended request's generated and drafted tokens to the stats."""
        self._counts["generated_tokens"] += r.gen.n_gen
        self._counts["drafted_tokens"] += r.gen.n_drafted
        self._counts["accepted_tokens"] += r.gen.n_accepted

    def _place(self, r: _Request) -> None:
        """Gives a newly admitted request a free slot, reusing the longest cached prefix."""
        used = {x.slot for x in self._running if x is not r}
        free = [s for s in range(self.n_parallel) if s not in used]
        limit = len(r.prompt) - 1                     # one token at least runs, for the logits
        mine = [s for s in range(self.n_parallel) if self._partition[s] == r.partition]
        share = {s: 0 for s in range(self.n_parallel)}
        m = self.model   # a slot's prefix as far as its sliding-window rings still hold it
        share.update({s: m.reusable_prefix(s, min(limit, common_prefix(m.seq_tokens(s), r.prompt)))
                      for s in mine})
        slot = max(free, key=lambda s: (share[s], -self._last_used[s]))
        src = max(range(self.n_parallel), key=lambda s: share[s])
        if share[src] > share[slot]:
            self.model.copy_seq(src, slot, share[src])
            share[slot] = share[src]
        if r.gen.prompt_logprobs is not None:   # every prompt position's logits are wanted
            share[slot] = 0
        elif self.prefix_cache is not None:     # its blocks may reach further than any slot
            share[slot] = self.prefix_cache.restore(slot, r.prompt[:limit], r.partition, share[slot])
        with self._cond:
            self._counts["prefix_cache_queries"] += len(r.prompt)
            self._counts["prefix_cache_hits"] += share[slot]
        r.slot, r.done_pos = slot, share[slot]
        r.n_reused = share[slot]
        if r.draft_model:   # its draft slot too starts from the longest prefix it can copy
            dm = self.draft_model
            if self._partition[slot] != r.partition:   # another partition's tokens: not reused
                dm.truncate_seq(slot, 0)
            d_share = {s: 0 for s in range(self.n_parallel)}
            d_share.update({s: dm.reusable_prefix(s, min(limit, common_prefix(dm.seq_tokens(s), r.prompt)))
                            for s in mine + [slot]})
            d_src = max(range(self.n_parallel), key=lambda s: d_share[s])
            if d_share[d_src] > d_share[slot]:
                dm.copy_seq(d_src, slot, d_share[d_src])
        self._partition[slot] = r.partition

    def _save_ended(self) -> None:
        """Puts the whole blocks that ended requests left in their slots into the prefix cache
        (a failed step's slots may be half written: not saved). A save that fails (the model
        busy elsewhere) is a later miss, never a request's error."""
        ended, self._ended = self._ended, []
        for r in ended if self.prefix_cache is not None else ():
            try:
                if r.slot >= 0:
                    self.prefix_cache.save(r.slot, r.partition)
            except Exception:
                pass

    def _run_step(self) -> None:
        tokens, seqs, pos, rows = [], [], [], []
        decoding = [r for r in self._running if r.done_pos >= len(r.prompt)]
        row_cost = self._pass_cost.row_cost(len(decoding))
        budget = MAX_DRAFT_ROWS                   # drafted rows this step, over all requests
        for r in decoding:
            r.draft = lookup_draft(r, row_cost, budget)
            budget -= len(r.draft)
        if self.draft_model is not None:
            model_drafts(self.draft_model,
                         [r for r in decoding if r.draft_model and not r.stream.cancelled],
                         len(decoding), row_cost, budget, prefill_chunk=self.prefill_chunk,
                         pass_cost=self._pass_cost, draft_pass_cost=self._draft_pass_cost)
        for r in decoding:   # its token, then its draft (if any), on consecutive rows
            run = [r.gen.token] + r.draft
            rows += range(len(tokens), len(tokens) + len(run))
            tokens += run
            seqs += [r.slot] * len(run)
            pos += range(r.done_pos, r.done_pos + len(run))
        n_decode_rows = len(tokens)
        pre = next((r for r in self._running if r.done_pos < len(r.prompt)), None)
        chunk_end = 0
        if pre is not None:
            chunk = self.prefill_chunk
            if pre.gen.prompt_logprobs is not None:
                chunk = min(chunk, PROMPT_LOGPROBS_SHARED if decoding else PROMPT_LOGPROBS_CHUNK)
            chunk_end = min(len(pre.prompt), pre.done_pos + chunk)
            if pre.t_prefill is None:
                pre.t_prefill = time.perf_counter()
            first_row = len(tokens)
            tokens += pre.prompt[pre.done_pos:chunk_end]
            seqs += [pre.slot] * (chunk_end - pre.done_pos)
            pos += range(pre.done_pos, chunk_end)
            if pre.gen.prompt_logprobs is not None:     # every row of the chunk
                rows += range(first_row, len(tokens))
            elif chunk_end == len(pre.prompt):
                rows.append(len(tokens) - 1)
        if not tokens:
            return
        self._step += 1
        last_chunk = pre is not None and chunk_end == len(pre.prompt)   # pre samples this step
        ahead = self._masks_ahead(decoding + ([pre] if last_chunk else []))
        t = time.perf_counter()
        try:
            logits = self.model.batch(np.array(tokens, np.int32), np.array(seqs, np.int32),
                                      np.array(pos, np.int32), np.array(rows, np.int32))
        finally:    # the matchers are the helper's until it is done
            if ahead is not None:
                ahead.result()
        if pre is None:     # a decode step (a prefill chunk's rows cost otherwise)
            self._pass_cost.add(len(tokens), time.perf_counter() - t)
        finished = []
        first = 0
        for r in decoding:
            n_rows = 1 + len(r.draft)
            self._feed_rows(r, logits[first:first + n_rows], finished)
            first += n_rows
        if pre is not None and pre.gen.prompt_logprobs is not None:
            chunk_rows = logits[n_decode_rows:]
            for j, p in enumerate(range(pre.done_pos, chunk_end)):
                if p + 1 < len(pre.prompt):
                    pre.gen.prompt_logprobs.append(token_logprob(
                        chunk_rows[j], pre.prompt[p + 1], pre.gen.logprobs or 0))
        if pre is not None:
            pre.done_pos = chunk_end
            if chunk_end == len(pre.prompt):
                pre.prefill_over = True
                pre.gen.prefilled(len(pre.prompt) - pre.n_reused, pre.t_prefill)
                with self._cond:
                    self._counts["prompt_eval_tokens"] += len(pre.prompt) - pre.n_reused
                if pre.gen.max_tokens == 0:
                    pre.stream._put(pre.gen.finish("length"))
                    finished.append(pre)
                else:
                    self._feed(pre, logits[-1], finished)
        if finished:
            with self._cond:
                for r in finished:
                    r.prefill_over = True
                    self._running.remove(r)
                    self._ended.append(r)
                    self._counts["failed" if r.failed else "completed"] += 1
                    self._count_tokens(r)
        for r in self._running + finished:     # a request that ended this step used it too
            self._last_used[r.slot] = self._step

    def _masks_ahead(self, reqs: list[_Request]):
        """Starts computing the grammar masks of the constrained requests among `reqs` (their
        next token's) on a helper thread, while model.batch runs: llguidance and the forward
        pass both release the GIL, so the masks take no time of the step."""
        gens = [r.gen for r in reqs if r.gen.constraint is not None]
        if not gens:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pyklei-mask")
        return self._mask_pool.submit(_fill_masks, gens)

    def _feed_rows(self, r: _Request, rows: np.ndarray, finished: list) -> None:
        """Feeds r's rows of this step: its token's, then its draft's while the draft holds
        (pyklei.runtime.speculative); its slot keeps the positions of the rows fed."""
        draft, q = r.draft, r.q
        r.gen.n_drafted += len(draft)
        accepted_before = r.gen.n_accepted
        for i, row in enumerate(rows):
            r.done_pos += 1
            if i < len(draft):
                self._feed(r, row, finished, draft[i], None if q is None else q[i])
            else:
                self._feed(r, row, finished)
            fed = not (r.stream.cancelled or r.failed)
            if not fed or r.gen.done or i == len(draft) or r.gen.token != draft[i]:
                break
        if draft:
            n_ok = r.gen.n_accepted - accepted_before
            r.draft_length.accepted(len(draft), n_ok, r.draft_kind)
            if n_ok < len(draft) and r.lookup is not None:
                r.lookup.rejected()
            self.model.truncate_seq(r.slot, r.done_pos)
            r.draft, r.q = [], None

    def _feed(self, r: _Request, logits: np.ndarray, finished: list,
              drafted: int | None = None, q: np.ndarray | None = None) -> None:
        """Samples r's next token (at a drafted position: `drafted`, see Generation.feed; drawn
        from q by a sampled draft model: Generation.feed_drafted). A failure here is r's alone
        (the model's step succeeded): r ends with RequestFailedError and the batch runs on
        without it."""
        if r.stream.cancelled:     # ended at the top of the next step
            return
        try:
            resp = (r.gen.feed(logits, drafted) if q is None
                    else r.gen.feed_drafted(logits, drafted, q))
        except Exception as e:
            err = RequestFailedError(f"request {r.stream.id} failed while sampling: "
                                     f"{type(e).__name__}: {e}")
            err.__cause__ = e
            r.failed = True
            r.stream._put(err)
            finished.append(r)
            return
        if resp is not None:
            r.stream._put(resp)
        if r.gen.done:
            finished.append(r)
        elif r.lookup is not None:
            r.lookup.extend([r.gen.token])


def _fill_masks(gens: list[Generation]) -> None:
    for g in gens:
        try:
            g.next_mask = g.constraint.fill_bitmask()
        except Exception:      # Generation.feed computes it again: that request fails alone
            g.next_mask = None


__all__ = ["Engine", "EngineClosedError", "GenerationResponse", "QueueFullError",
           "RequestFailedError", "RequestStream"]
