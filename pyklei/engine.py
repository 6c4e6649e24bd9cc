"""A request engine: many generation requests on one Model, behind one scheduler thread.

    engine = Engine(Model("smollm2.gguf"), tokenizer, n_parallel=4)
    stream = engine.submit(prompt_ids, max_tokens=64, params=SamplingParams(temperature=0))
    for r in stream:                       # GenerationResponse, as stream_generate yields them
        print(r.text, end="")
    engine.shutdown()

FIRST VERSION (the interface, issue 16): the scheduler thread runs the requests one at a time
with stream_generate on the model's single KV cache; n_parallel is accepted and reported but
not used yet. Continuous batching (several requests decoded in one step, each in its own KV
slot) replaces the inside of this class with the same interface (branch `batch`).

Requests wait in a queue of at most max_queue (QueueFullError beyond). A cancelled request ends
at its next token with finish_reason "cancelled" (queued: at once). Responses are those of
stream_generate (time_to_first_token counts from the start of its prefill here).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from typing import Sequence

from .generate import GenerationResponse, peak_rss_mb, stream_generate, token_budget
from .model import Model
from .sampler import SamplingParams


class QueueFullError(RuntimeError):
    """submit() while max_queue requests are already waiting for a slot."""


class EngineClosedError(RuntimeError):
    """submit() after shutdown()."""


_ids = itertools.count(1)


class RequestStream:
    """One request's responses. Iterating blocks until the next response; the last one has
    finish_reason set ("stop", "length" or "cancelled"). An error of the engine while the
    request ran is raised from the iteration. Thread-safe."""

    def __init__(self, engine: "Engine", prompt_tokens: int):
        self.id = f"req-{next(_ids)}"
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._items: deque = deque()
        self._ready = threading.Condition(threading.Lock())
        self.cancelled = False

    def _put(self, item) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()

    def __iter__(self):
        while True:
            with self._ready:
                while not self._items:
                    self._ready.wait()
                item = self._items.popleft()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Stops the request at its next token; the stream ends with a response whose
        finish_reason is "cancelled" (unless it had already finished)."""
        self.cancelled = True
        self._engine._wake()


class _Request:
    __slots__ = ("stream", "prompt", "budget", "params", "stop", "eos_ids")

    def __init__(self, stream, prompt, budget, params, stop, eos_ids):
        self.stream, self.prompt, self.budget = stream, prompt, budget
        self.params, self.stop, self.eos_ids = params, stop, eos_ids


class Engine:
    def __init__(self, model: Model, tokenizer, *, n_parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = 256):
        for name, v in (("n_parallel", n_parallel), ("max_queue", max_queue),
                        ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        model.check_open()
        self.model, self.tokenizer = model, tokenizer
        self.n_parallel, self.max_queue, self.prefill_chunk = n_parallel, max_queue, prefill_chunk
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._closing = False
        self._counts = dict(completed=0, cancelled=0, generated_tokens=0, prompt_tokens=0,
                            prompt_eval_tokens=0)
        self._thread = threading.Thread(target=self._loop, name="pyklei-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], *, max_tokens: int | None = 256,
               params: SamplingParams | None = None, stop: Sequence[str] = (),
               eos_ids: Sequence[int] | None = None, trim: bool = False) -> RequestStream:
        """Queues a generation; checks it at the call as stream_generate does (ValueError,
        TypeError). QueueFullError when max_queue requests wait, EngineClosedError after
        shutdown()."""
        if self._closing:
            raise EngineClosedError("the engine is shut down")
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        budget = token_budget(self.model.n_ctx, len(prompt), max_tokens, trim=trim)
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.vocab_size})")
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a list of strings, got {stop!r}")
        stream = RequestStream(self, len(prompt))
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is shut down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting "
                                     f"(max_queue={self.max_queue})")
            self._waiting.append(_Request(stream, prompt, budget, params, list(stop), eos_ids))
            self._cond.notify_all()
        return stream

    def stats(self) -> dict:
        with self._cond:
            return dict(queued=len(self._waiting), running=len(self._running),
                        n_parallel=self.n_parallel, **self._counts)

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stops accepting requests; finishes the running and queued ones (cancel=False) or
        cancels them all, then ends the scheduler thread (waiting at most `timeout` seconds).
        Idempotent."""
        with self._cond:
            self._closing = True
            if cancel:
                for r in itertools.chain(self._waiting, self._running):
                    r.stream.cancelled = True
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

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._closing):
                    self._cond.wait()
                for r in [r for r in self._waiting if r.stream.cancelled]:
                    self._waiting.remove(r)
                    self._counts["cancelled"] += 1
                    r.stream._put(_cancelled(None, len(r.prompt), r.budget))
                if not self._waiting:
                    if self._closing:
                        return
                    continue
                r = self._waiting.popleft()
                self._running.append(r)
                self._counts["prompt_tokens"] += len(r.prompt)
            self._run(r)
            with self._cond:
                self._running.remove(r)

    def _run(self, r: _Request) -> None:
        last = None
        try:
            it = stream_generate(self.model, self.tokenizer, r.prompt, r.budget, r.params, r.stop,
                                 r.eos_ids)
            for resp in it:
                if r.stream.cancelled:
                    it.close()
                    break
                last = resp
                if resp.finish_reason is not None:
                    break
                r.stream._put(resp)
        except BaseException as e:
            r.stream._put(e)
            return
        with self._cond:
            if last is not None:
                self._counts["generated_tokens"] += last.generation_tokens
                self._counts["prompt_eval_tokens"] += last.prompt_eval_tokens
            if last is None or last.finish_reason is None:
                self._counts["cancelled"] += 1
                r.stream._put(_cancelled(last, len(r.prompt), r.budget))
            else:
                self._counts["completed"] += 1
                r.stream._put(last)


def _cancelled(last: GenerationResponse | None, n_prompt: int, budget: int) -> GenerationResponse:
    if last is not None:
        return dataclasses.replace(last, text="", finish_reason="cancelled")
    return GenerationResponse(text="", token=None, finish_reason="cancelled", prompt_tokens=n_prompt,
                              prompt_eval_tokens=0, generation_tokens=0, time_to_first_token=0.0,
                              prompt_tps=0.0, generation_tps=0.0, peak_rss_mb=peak_rss_mb(),
                              max_tokens=budget)


__all__ = ["Engine", "EngineClosedError", "GenerationResponse", "QueueFullError", "RequestStream"]
