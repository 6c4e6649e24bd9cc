"""A replica's stream under `serve --ray` (ray_serve_app._coalesced): the response's start and
its first body chunk at once, later chunks joined over the flush interval, nothing lost,
reordered or held past the end. Plain asyncio: no Ray needed."""
import asyncio

from pyklei.distributed.ray_serve_app import _coalesced

START = {"type": "http.response.start", "status": 200, "headers": []}


def body(b: bytes, more=True) -> dict:
    return {"type": "http.response.body", "body": b, "more_body": more}


def run(feed, flush_s: float):
    """[(seconds since start, item)] that _coalesced yields while `feed` (an async function of
    the queue) puts messages."""
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        producer = asyncio.create_task(feed(q))
        got = [(loop.time() - t0, part) async for part in _coalesced(q, flush_s)]
        await producer
        return got
    return asyncio.run(main())


def test_start_and_first_chunk_at_once_then_a_burst_joined():
    async def feed(q):
        await q.put(START)
        for i in range(6):                    # a token every 10 ms
            await q.put(body(b"data: %d\n\n" % i))
            await asyncio.sleep(0.01)
        await q.put(body(b"data: [DONE]\n\n", more=False))

    got = run(feed, 0.035)
    assert got[0][1] is START
    assert got[1][1] == b"data: 0\n\n" and got[1][0] < 0.005          # the first token: no wait
    parts = [p for _, p in got[2:]]
    assert b"".join(parts) == b"".join(b"data: %d\n\n" % i for i in range(1, 6)) + b"data: [DONE]\n\n"
    assert len(parts) < 5                                              # joined, not one per token
    assert all(p.endswith(b"\n\n") for p in parts)                     # whole SSE events


def test_a_slow_stream_is_not_held_past_the_interval():
    async def feed(q):
        await q.put(START)
        await q.put(body(b"a"))
        await q.put(body(b"b"))
        await asyncio.sleep(0.2)              # a long pause: "b" must not wait for it
        await q.put(body(b"c", more=False))

    got = run(feed, 0.02)
    times = {p: t for t, p in got[1:]}
    assert list(times) == [b"a", b"b", b"c"]
    assert times[b"b"] < 0.1 and times[b"c"] >= 0.2


def test_the_app_ending_flushes_what_is_pending():
    async def feed(q):
        await q.put(START)
        await q.put(body(b"x"))
        await q.put(body(b"y"))
        await q.put(body(b"z"))
        await q.put(None)                     # the app ended without more_body=False

    got = run(feed, 10.0)
    assert [p for _, p in got[1:]] == [b"x", b"yz"] and got[-1][0] < 1.0


def test_a_whole_response_is_one_chunk_and_empty_bodies_are_dropped():
    async def feed(q):
        await q.put(START)
        await q.put(body(b""))
        await q.put(body(b'{"ok": true}', more=False))
        await q.put(body(b"after the end"))   # never read: the response ended

    got = run(feed, 0.05)
    assert [p for _, p in got] == [START, b'{"ok": true}']
