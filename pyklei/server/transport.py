"""Sockets and connections of `pyklei serve`, below the HTTP app: what keeps slow, idle or
too many clients from locking the others out.

- `bind()`: the listening socket, made with IPPROTO_TCP so that asyncio sets TCP_NODELAY on
  every accepted connection (it only does for sockets whose proto says TCP). Without it a
  response written in two pieces (headers, then body) waits for the client's delayed ACK:
  about 40 ms on every kept-alive request.
- `open_file_budget()`: raises the soft open-file limit towards the hard one and says how many
  connections fit in it, leaving room for the model file, logs and threads.
- `protocol_class()`: uvicorn's h11 protocol plus two guards uvicorn lacks. A connection must
  finish a request's headers within `header_timeout` seconds of its first byte (or of being
  accepted), else it is closed: half-sent requests (slowloris) cannot pile up. A connection
  beyond `max_connections` is answered 503 at once and closed, before it can hold a file
  descriptor for long: a flood gets 503s instead of exhausting the process's files. Idle
  kept-alive connections are closed by uvicorn's own timeout_keep_alive; the body's deadline
  is the app's (intake.read_json). A chunked body that announces a chunk larger than the app's
  body limit (`max_body`) gets 413 at once and its connection is closed, rather than holding
  the connection until the body's deadline (chunk sizes that are not hex are uvicorn's 400).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time

FD_RESERVE = 64      # descriptors kept for the model file, the log, threads and the listener
NOFILE_WANTED = 1 << 16
ACCEPT_ERROR_EVERY_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one), so the address is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def open_file_budget() -> int:
    """Connections this process can hold open: the soft RLIMIT_NOFILE, raised to the hard limit
    (at most 65536) first, less FD_RESERVE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE_WANTED if hard == resource.RLIM_INFINITY else min(hard, NOFILE_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = NOFILE_WANTED
    return soft - FD_RESERVE


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """When the process runs out of file descriptors, asyncio logs a traceback for every
    failed accept (megabytes a minute under a flood); log one line every
    ACCEPT_ERROR_EVERY_S seconds instead. Other errors go to the handler that was there."""
    previous = loop.get_exception_handler()
    last = [float("-inf")]

    def handler(loop, context):
        if context.get("message") == "socket.accept() out of system resource":
            now = time.monotonic()
            if now - last[0] >= ACCEPT_ERROR_EVERY_S:
                last[0] = now
                logging.getLogger("uvicorn.error").warning(
                    "out of file descriptors (%s): new connections wait; see --max-connections",
                    context.get("exception"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _too_large_response(max_body: int) -> bytes:
    body = json.dumps({"error": {"message": f"a chunk of the body is larger than the body may "
                                 f"be ({max_body} bytes)", "type": "invalid_request_error",
                                 "param": None, "code": None}}).encode()
    return (b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


def _overflow_response() -> bytes:
    body = json.dumps({"error": {
        "message": "the server has too many open connections; retry later",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def protocol_class(header_timeout: float, max_connections: int, max_body: int):
    """uvicorn's H11Protocol with a header deadline, a connection cap and a chunk size bound
    (module doc)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None
        _rejected = False

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._rejected = True
                transport.write(_overflow_response())
                transport.close()
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._rejected:
                return
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._rejected:
                return
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()          # the first byte of the next request
            super().data_received(data)
            # h11 keeps the announced size of the chunk being read (its reader's own field;
            # without it, this guard is off and the body's deadline still holds)
            pending = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
            if isinstance(pending, int) and pending > max_body and not self.transport.is_closing():
                if self.cycle is None or not self.cycle.response_started:
                    self.transport.write(_too_large_response(max_body))
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:           # a request's headers are complete
                self._cancel_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
