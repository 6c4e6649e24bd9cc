"""pyklei.server.model_registry on stand-in engines (no model, no HTTP): LRU unloading of
idle models only, a refusal when every loaded model is busy, one load for concurrent requests,
a failed load, counters that survive an unload, and the one-model registry's any-name rule.
tests/server/test_multi_model.py runs the same through a real server."""
import asyncio

import pytest

from pyklei.runtime.engine import EngineClosedError
from pyklei.server.model_registry import (ModelLoadError, ModelRegistry, ModelsBusyError,  # noqa: E402
                                          ServedModel, UnknownModelError)


class _Engine:
    def __init__(self, completed=0):
        self.completed, self.closed = completed, False

    def stats(self):
        return dict(queued=0, running=0, n_parallel=2, completed=self.completed, cancelled=0)

    def shutdown(self, cancel=False, timeout=None):
        self.closed = True


def _registry(ids, max_loaded, opened, fail=()):
    """A registry of `ids` (the first loaded); opened: the ids in the order they were opened."""
    reg = ModelRegistry(max_loaded)

    def opener(mid):
        def open_model():
            if mid in fail:
                raise OSError(f"cannot read {mid}.gguf")
            opened.append(mid)
            engine = _Engine()
            return ServedModel(mid, engine, None, 512, close=engine.shutdown)
        return open_model

    for i, mid in enumerate(ids):
        reg.add(mid, opener(mid), loaded=opener(mid)() if i == 0 else None)
    opened.clear()
    return reg


def _states(reg):
    return {m["id"]: m["status"] for m in reg.models()}


def test_the_least_recently_used_idle_model_is_unloaded():
    async def main():
        opened = []
        reg = _registry(["a", "b", "c"], 2, opened)
        (await reg.acquire("b")).release()
        (await reg.acquire("a")).release()          # a is now more recent than b
        lease_c = await reg.acquire("c")
        assert _states(reg) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert opened == ["b", "c"]
        lease_c.release()
        assert (await reg.acquire(None)).served.model_id == "a"   # no name: the default
    asyncio.run(main())


def test_a_model_with_a_lease_is_never_unloaded():
    async def main():
        reg = _registry(["a", "b"], 1, [])
        lease_a = await reg.acquire("a")
        with pytest.raises(ModelsBusyError, match="'a'"):
            await reg.acquire("b")
        assert _states(reg) == {"a": "loaded", "b": "unloaded"}
        lease_a.release()
        lease_a.release()                            # idempotent
        lease_b = await reg.acquire("b")
        assert _states(reg) == {"a": "unloaded", "b": "loaded"} and lease_b.served.model_id == "b"
    asyncio.run(main())


def test_concurrent_requests_for_one_unloaded_model_load_it_once():
    async def main():
        opened = []
        reg = _registry(["a", "b"], 2, opened)
        leases = await asyncio.gather(*(reg.acquire("b") for _ in range(5)))
        assert opened == ["b"] and {x.served.model_id for x in leases} == {"b"}
        assert [m["loads"] for m in reg.models()] == [0, 1]
    asyncio.run(main())


def test_a_requester_who_leaves_does_not_stop_the_load():
    async def main():
        opened = []
        reg = _registry(["a", "b"], 2, opened)
        task = asyncio.ensure_future(reg.acquire("b"))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.2)
        assert _states(reg)["b"] == "loaded" and opened == ["b"]
    asyncio.run(main())


def test_a_failed_load_says_why_and_leaves_the_model_unloaded():
    async def main():
        reg = _registry(["a", "b"], 2, [], fail={"b"})
        with pytest.raises(ModelLoadError, match="'b' could not be loaded: OSError: cannot read"):
            await reg.acquire("b")
        assert _states(reg) == {"a": "loaded", "b": "unloaded"}
    asyncio.run(main())


def test_counters_survive_an_unload_and_gauges_count_the_loaded():
    async def main():
        reg = _registry(["a", "b"], 1, [])
        a = await reg.acquire("a")
        a.served.engine.completed = 3
        a.release()
        (await reg.acquire("b")).release()
        s = reg.stats()
        assert s["completed"] == 3 and s["n_parallel"] == 2      # a's 3 kept; b alone loaded
    asyncio.run(main())


def test_unknown_names():
    async def main():
        reg = _registry(["a", "b"], 2, [])
        with pytest.raises(UnknownModelError, match="no model 'x'; this server has 'a', 'b'"):
            await reg.acquire("x")
        with pytest.raises(UnknownModelError):
            reg.status("x")
        one = ModelRegistry.of_one(ServedModel("m", _Engine(), None, 512))
        assert (await one.acquire("anything")).served.model_id == "m"
        with pytest.raises(UnknownModelError):
            one.status("anything")          # GET /v1/models/{id} names the model exactly
    asyncio.run(main())


def test_shutdown_closes_every_loaded_engine_and_refuses_loads():
    async def main():
        reg = _registry(["a", "b"], 2, [])
        b = await reg.acquire("b")
        b.release()
        reg.shutdown()
        assert len(reg.loaded()) == 2 and all(s.engine.closed for s in reg.loaded())
        with pytest.raises(EngineClosedError):
            await reg.acquire("a")
    asyncio.run(main())
