"""Batch lines run through one pyklei engine (continuous batching), with the server's own
request checks and reply building, so a line's result is what its endpoint would answer.

    runner = EngineRunner(engine, tokenizer, model_id="smollm2", created=created_of(path))
    for data in runner.run(lines):          # lines.BatchLine -> encoded output lines, in order
        out.write(data)

Requests are submitted ahead of the one being written, up to `in_flight` engine sequences (a
request of n choices counts n), so the engine's slots stay full while results go out in the
input's order. A line's checks (tokenizing, templating, compiling a grammar) run on this thread
while the engine's thread decodes the others.

A request fails alone, as on the server: its checks' APIError (400, naming the field) or its
generation's failure (500) is its result line. Only the engine closing ends the job.
"""
from __future__ import annotations

import time
from collections import deque

from ..runtime.engine import (EMBEDDING_SLOTS, Engine, EngineClosedError, QueueFullError,
                              RequestFailedError)
from ..server import embeddings_api, openai_api as api
from ..server.whole_reply import WholeReply, generation_failed, submit
from . import lines as L


def _batch_checks(kind: str, body: dict) -> None:
    """What a batch line's body may not hold beyond the endpoint's own rules: a model that is
    no name (as the server's), a stream (a batch result is written whole)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise api.APIError("'model' must be a string: a model's id", "model")
    if kind != "embeddings" and body.get("stream"):
        raise api.APIError("'stream' is not available in a batch: each result is written whole",
                           "stream")


class _Pending:
    """A line in flight: its result already known (`out`), or the engine's work for it."""
    __slots__ = ("line", "out", "req", "streams", "future")

    def __init__(self, line, out=None, req=None, streams=(), future=None):
        self.line, self.out, self.req, self.streams, self.future = line, out, req, streams, future


class EngineRunner:
    def __init__(self, engine, tokenizer, model_id: str, created: int,
                 in_flight: int | None = None):
        """engine: a pyklei.runtime.engine.Engine, over a model with slots for embeddings beyond
        its n_parallel (EMBEDDING_SLOTS) if lines ask for embeddings, and a max_queue of at
        least `in_flight` (default: twice its n_parallel) plus the largest n of a request."""
        self.engine, self.tokenizer, self.model_id, self.created = engine, tokenizer, model_id, created
        self.n_ctx = engine.n_ctx
        self.in_flight = in_flight or 2 * engine.n_parallel

    def run(self, lines):
        """The encoded output line of each BatchLine, in their order (a generator)."""
        pending: deque[_Pending] = deque()
        busy = 0                       # engine sequences in flight
        for line in lines:
            p = self._start(line)
            pending.append(p)
            busy += len(p.streams) or (p.future is not None)
            while pending and (busy > self.in_flight or pending[0].out is not None):
                head = pending.popleft()
                busy -= len(head.streams) or (head.future is not None)
                yield self._finish(head)
        while pending:
            yield self._finish(pending.popleft())

    def _start(self, line: L.BatchLine) -> _Pending:
        if line.problem is not None:
            return _Pending(line, L.malformed(line))
        try:
            _batch_checks(line.kind, line.body)
            if line.kind == "embeddings":
                req = embeddings_api.parse(line.body, self.tokenizer, self.n_ctx, self.engine.model)
                return _Pending(line, req=req, future=self._queued(
                    lambda: self.engine.embed(req.ids, req.pooling), "input"))
            req = api.parse(line.kind, line.body, self.tokenizer, self.n_ctx)
            return _Pending(line, req=req, streams=self._queued(
                lambda: submit(self.engine, req, self.tokenizer.eos_ids, (None, req.cache_salt)),
                None))
        except api.APIError as e:
            return _Pending(line, L.result(line, e.status, e.body()))
        except EngineClosedError:
            raise
        except Exception as e:          # a bug shows in its line, as the server's 500 would
            return _Pending(line, L.result(line, 500, _internal(e).body()))

    def _queued(self, queue, param):
        """queue() (a submit), waiting for room while the engine's queue is full: what is
        submitted ahead is bounded by in_flight, so room comes as requests end."""
        while True:
            try:
                return queue()
            except QueueFullError:
                # the engine's queue is sized for in_flight; it is full only while the requests
                # before this one still wait, which the scheduler drains
                time.sleep(0.01)
            except (TypeError, ValueError) as e:
                raise api.APIError(str(e), param) from None

    def _finish(self, p: _Pending) -> bytes:
        if p.out is None:
            p.out = self._gather(p)
        return L.encode(p.out)

    def _gather(self, p: _Pending) -> dict:
        line = p.line
        try:
            if p.future is not None:
                body = embeddings_api.response(p.req, p.future.result(), self.model_id)
                return L.result(line, 200, body)
            reply = WholeReply(p.req)
            for i, stream in enumerate(p.streams):
                for r in stream:
                    reply.add(i, r)
            body = reply.body(L.response_id(line, p.req.kind), self.model_id, self.tokenizer)
            return L.result(line, 200, L.reproducible(body, self.created))
        except RequestFailedError as e:
            return L.result(line, 500, generation_failed(e).body())
        except EngineClosedError:
            raise
        except Exception as e:         # an engine step that failed fails its requests alone
            for stream in p.streams:
                stream.cancel()
            return L.result(line, 500, _internal(e).body())


def _internal(e: Exception) -> api.APIError:
    return api.APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error")


def load_engine(model: str, n_parallel: int, **load_kwargs):
    """(pyklei.LLM, Engine) for a batch job: the model file loaded with pyklei.load's keywords,
    KV cache slots for n_parallel sequences and the embeddings', a queue for what EngineRunner
    keeps in flight (its default) and the largest n a request may ask for."""
    from ..llm import load

    llm = load(model, n_seq=n_parallel + EMBEDDING_SLOTS, **load_kwargs)
    kw = {} if load_kwargs.get("n_batch") is None else {"prefill_chunk": load_kwargs["n_batch"]}
    engine = Engine(llm.model, llm.tokenizer, n_parallel=n_parallel,
                    max_queue=2 * n_parallel + api.MAX_N, **kw)
    return llm, engine
