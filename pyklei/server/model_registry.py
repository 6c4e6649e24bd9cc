"""Several models behind one server: which models exist, which are loaded, and when one is
loaded or unloaded (`pyklei serve a.gguf b.gguf`, `--models-dir DIR`, `--models-max N`).

A request names its model by the `model` field; `acquire(name)` gives it a `Lease` on that
model's `ServedModel` (engine, tokenizer, n_ctx, model_id), loading the model first when it is
not resident. The lease is held until the request's response has been sent entirely (app.py
releases it then), and a model with a lease is never unloaded: a request for a model that
must be loaded while `max_loaded` models are resident unloads the least recently used one
that has no lease, or, when every resident model has requests, fails with ModelsBusyError at
once (the server answers 503) rather than evicting a model mid-reply or waiting an unbounded
time for one to become idle.

Loading and unloading happen in worker threads, one at a time (the load lock), and never on
the event loop: requests for models that are already loaded go on meanwhile. Two requests for
the same unloaded model share one load (entry.loading, a task that outlives a requester who
hangs up). All bookkeeping runs on the event loop, so a check and the change it leads to are
never separated by another request.

The server's figures (/health, /metrics) are the sum over the loaded engines plus what the
unloaded ones had counted, so that counters never go down when a model is unloaded.

With one model (`pyklei serve a.gguf`) any name, or none, is that model, as before.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from dataclasses import dataclass
from typing import Callable

from ..runtime.engine import EngineClosedError

# Engine.stats() keys that are gauges (now), not counters (since start)
GAUGES = ("queued", "running", "n_parallel", "kv_used_tokens", "kv_capacity_tokens",
          "prefix_cache_bytes", "prefix_cache_capacity_bytes")


@dataclass
class ServedModel:
    """One loaded model as a request uses it. close(): shuts its engine down and frees the
    model's memory (blocking: called in a worker thread); None for a model never unloaded."""
    model_id: str
    engine: object
    tokenizer: object
    n_ctx: int
    close: Callable[[], None] | None = None


class UnknownModelError(LookupError):
    def __init__(self, name, ids):
        shown = name if len(name) <= 100 else name[:100] + "..."     # a body may send megabytes
        super().__init__(f"no model {shown!r}; this server has {', '.join(map(repr, ids))}")
        self.name, self.ids = name, list(ids)


class ModelsBusyError(RuntimeError):
    """Loading a model needs a resident one unloaded, and every resident one has requests."""


class ModelLoadError(RuntimeError):
    """The model's file could not be loaded (the message says why)."""


class _Entry:
    def __init__(self, model_id: str, open_model: Callable[[], ServedModel] | None):
        self.model_id, self.open_model = model_id, open_model
        self.served: ServedModel | None = None
        self.state = "unloaded"             # unloaded -> loading -> loaded -> unloading -> ...
        self.leases = 0                     # requests using it now (never unloaded while > 0)
        self.loads = 0                      # times loaded on demand (reloads show thrashing)
        self.last_used = 0.0                # time.monotonic() of the last acquire or release
        self.loading: asyncio.Task | None = None


class Lease:
    """A request's hold on a loaded model; release() (idempotent) lets it be unloaded again."""

    def __init__(self, registry: "ModelRegistry", entry: _Entry):
        self.served = entry.served
        self._registry, self._entry = registry, entry

    def release(self) -> None:
        if self._entry is not None:
            self._entry.leases -= 1
            self._entry.last_used = time.monotonic()
            # a kept-alive connection keeps its last request's scope, and this lease with it:
            # an unloaded model's objects must not stay reachable from there
            self._entry = self.served = None


class ModelRegistry:
    def __init__(self, max_loaded: int, any_name_is_default: bool = False):
        """max_loaded: at most this many models resident at once; any_name_is_default: a
        request naming a model this server does not have gets the default one (the one-model
        server's behaviour) instead of UnknownModelError."""
        if not isinstance(max_loaded, int) or max_loaded < 1:
            raise ValueError(f"max_loaded must be an integer >= 1, got {max_loaded!r}")
        self.max_loaded = max_loaded
        self.any_name_is_default = any_name_is_default
        self._entries: dict[str, _Entry] = {}     # in order: the first is the default
        self._lock: asyncio.Lock | None = None    # made on the event loop, on first use
        self._retired = {}                        # counters of engines already unloaded
        self._closing = False

    @classmethod
    def of_one(cls, served: ServedModel) -> "ModelRegistry":
        """A server of one loaded model that every request gets, whatever it names."""
        r = cls(1, any_name_is_default=True)
        r.add(served.model_id, loaded=served)
        return r

    def add(self, model_id: str, open_model: Callable[[], ServedModel] | None = None,
            loaded: ServedModel | None = None) -> None:
        """A model this server serves: open_model() loads it (blocking, in a worker thread),
        `loaded` is one already loaded (counts against max_loaded)."""
        if model_id in self._entries:
            raise ValueError(f"two models are named {model_id!r}")
        e = self._entries[model_id] = _Entry(model_id, open_model)
        if loaded is not None:
            if sum(x.state == "loaded" for x in self._entries.values()) >= self.max_loaded:
                raise ValueError(f"more than max_loaded={self.max_loaded} models loaded")
            e.served, e.state, e.last_used = loaded, "loaded", time.monotonic()

    @property
    def ids(self) -> list[str]:
        return list(self._entries)

    @property
    def default_id(self) -> str:
        return next(iter(self._entries))

    def entry_for(self, name) -> _Entry:
        """The model a request's `model` field names (None: the default)."""
        if name is None:
            return self._entries[self.default_id]
        e = self._entries.get(name)
        if e is None:
            if not self.any_name_is_default:
                raise UnknownModelError(name, self.ids)
            e = self._entries[self.default_id]
        return e

    def status(self, model_id: str) -> str:
        """"loaded", "loading", "unloading" or "unloaded" (UnknownModelError for no such model)."""
        e = self._entries.get(model_id)
        if e is None:
            raise UnknownModelError(model_id, self.ids)
        return e.state

    # ---- a request's model -------------------------------------------------------------
    async def acquire(self, name) -> Lease:
        """A lease on the model `name` names (module doc), loading it first if need be.
        Raises UnknownModelError, ModelsBusyError, ModelLoadError, or EngineClosedError once
        the server is stopping."""
        e = self.entry_for(name)
        if self._closing:
            raise EngineClosedError("the server is shutting down")
        # loop: the model a finished load brought in may have been unloaded again by another
        # load before this coroutine ran (only if it was idle, so this is rare)
        while e.state != "loaded":
            if e.loading is None:
                e.loading = asyncio.ensure_future(self._bring_in(e))
                e.loading.add_done_callback(_retrieve)
            await asyncio.shield(e.loading)      # a requester who leaves does not stop the load
            if self._closing:
                raise EngineClosedError("the server is shutting down")
        e.leases += 1
        e.last_used = time.monotonic()
        return Lease(self, e)

    async def _bring_in(self, e: _Entry) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:          # one load or unload at a time
                if e.state == "loaded":
                    return
                for victim in self._victims():
                    await self._unload(victim)
                e.state = "loading"
                try:
                    e.served = await asyncio.to_thread(e.open_model)
                except Exception as err:
                    e.state = "unloaded"
                    raise ModelLoadError(f"model {e.model_id!r} could not be loaded: "
                                         f"{type(err).__name__}: {err}") from err
                e.state, e.last_used = "loaded", time.monotonic()
                e.loads += 1
                if self._closing:      # stopped while it loaded: no request will run on it
                    e.served.engine.shutdown(cancel=True, timeout=0)
        finally:
            e.loading = None

    def _victims(self) -> list[_Entry]:
        """The idle models to unload so that one more fits, least recently used first;
        ModelsBusyError when too few are idle. Marks them unloading at once (no lease can be
        taken on them from here on)."""
        loaded = [x for x in self._entries.values() if x.state == "loaded"]
        need = len(loaded) + 1 - self.max_loaded
        if need <= 0:
            return []
        idle = sorted((x for x in loaded if x.leases == 0 and x.open_model is not None),
                      key=lambda x: x.last_used)
        if len(idle) < need:
            busy = [x.model_id for x in loaded if x.leases > 0]
            raise ModelsBusyError(
                f"loading another model needs a loaded one unloaded (at most "
                f"{self.max_loaded} loaded: --models-max), and every loaded model "
                f"({', '.join(map(repr, busy))}) has requests running; a model is never "
                f"unloaded while it has requests: retry when they finish")
        for x in idle[:need]:
            x.state = "unloading"
        return idle[:need]

    async def _unload(self, e: _Entry) -> None:
        served, e.served = e.served, None
        try:
            await asyncio.to_thread(_close_and_give_back, served)
        finally:
            counts = served.engine.stats()
            for k, v in counts.items():
                if k not in GAUGES:
                    self._retired[k] = self._retired.get(k, 0) + v
            e.state = "unloaded"

    # ---- the server's view -----------------------------------------------------------------
    def models(self) -> list[dict]:
        """Each model's id, state and how often it was loaded on demand, in the configured
        order (the default first)."""
        return [{"id": e.model_id, "status": e.state, "loads": e.loads}
                for e in self._entries.values()]

    def loaded(self) -> list[ServedModel]:
        return [e.served for e in self._entries.values()
                if e.state == "loaded" and e.served is not None]

    def stats(self) -> dict:
        """Engine.stats() summed over the loaded engines (gauges) and over every engine this
        server has run (counters)."""
        total = dict.fromkeys(GAUGES, 0)
        total.update(self._retired)
        for served in self.loaded():
            for k, v in served.engine.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    def shutdown(self, cancel: bool = True, timeout: float | None = None) -> None:
        """Shuts every loaded engine down (the server is stopping; the models stay mapped
        until the process ends). Idempotent."""
        self._closing = True
        for e in self._entries.values():
            if e.served is not None:
                e.served.engine.shutdown(cancel=cancel, timeout=timeout)


def _close_and_give_back(served: ServedModel) -> None:
    """Closes the model, then hands the freed memory back to the system: glibc keeps freed
    blocks of the engine's and loader's threads in their malloc arenas (and raises its mmap
    threshold after a large block is freed), so without malloc_trim the next model's memory
    comes on top of the last one's and --models-max would not bound the resident size."""
    served.close()
    gc.collect()             # cycles that still hold the model's Python objects
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):     # not glibc
        pass


def _retrieve(task: asyncio.Task) -> None:
    """A load whose requesters all left: its error is not 'never retrieved'."""
    if not task.cancelled():
        task.exception()
