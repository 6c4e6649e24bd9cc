"""Server-Sent Events out: one event's bytes, and a streamed reply that writes an async
iterator of them under the server's write timeout.

A client that stops reading blocks the send (uvicorn's flow control); after `write_timeout`
seconds of that its request is cancelled (WriteTimeout), so a stalled reader never holds an
engine slot. A client that hangs up is noticed by the generation's disconnect watcher.
"""
from __future__ import annotations

import asyncio
import json
import logging

log = logging.getLogger("uvicorn.error")
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]       # nginx: pass each event on at once


class WriteTimeout(Exception):
    """The client did not take a streamed reply's bytes within the write timeout."""


async def within(seconds: float, awaitable):
    """awaitable, or asyncio.TimeoutError after `seconds`. asyncio.timeout (3.11) arms a timer;
    wait_for, before it, wraps each send of a stream's tokens in a task of its own."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def named_event(event: dict) -> bytes:
    """One event named by its type, as the Responses and Messages APIs stream them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class EventStream:
    """An ASGI reply streaming `events` (an async iterator of bytes). gen: the request's
    app._Generation (its disconnect watcher runs beside, and it is closed at the end)."""

    def __init__(self, gen, events, write_timeout: float):
        self.gen, self.events, self.write_timeout = gen, events, write_timeout

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self.gen.watch_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            async for data in self.events:
                try:
                    await within(self.write_timeout, send(
                        {"type": "http.response.body", "body": data, "more_body": True}))
                except asyncio.TimeoutError:
                    raise WriteTimeout() from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                    # the client went away while we wrote
            pass
        except WriteTimeout:               # the client stopped reading: its request ends
            log.warning("a streamed reply was not read for %g s: request cancelled",
                        self.write_timeout)
        finally:
            watcher.cancel()
            self.gen.close()
            await self.events.aclose()
