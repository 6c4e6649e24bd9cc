"""A request's stream of responses (pyklei.runtime.engine): the engine's scheduler thread puts
each response (or the error that ended the request) in, the caller's thread iterates.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

_ids = itertools.count(1)


class RequestStream:
    """One request's responses. Iterating blocks until the next response; the last one has
    finish_reason set ("stop", "length" or "cancelled"). An error of the engine while the
    request ran is raised from the iteration. Thread-safe."""

    def __init__(self, engine, prompt_tokens: int):
        self.id = f"req-{next(_ids)}"
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._items: deque = deque()
        self._ready = threading.Condition(threading.Lock())
        self._ended = False        # the last response (or an error) was taken
        self.cancelled = False

    def _put(self, item) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()

    def __iter__(self):
        while True:
            with self._ready:
                if self._ended:    # a second iteration after the end: nothing more comes
                    return
                while not self._items:
                    self._ready.wait()
                item = self._items.popleft()
                self._ended = isinstance(item, BaseException) or item.finish_reason is not None
            if isinstance(item, BaseException):
                raise item
            yield item
            if self._ended:
                return

    def cancel(self) -> None:
        """Stops the request: its slot is freed at the engine's next step, and the stream ends
        with a response whose finish_reason is "cancelled" (unless it had already finished)."""
        self.cancelled = True
        self._engine._wake()


__all__ = ["RequestStream"]
