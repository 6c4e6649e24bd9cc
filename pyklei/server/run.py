"""Runs the server: one model, one engine, one uvicorn server on a socket bound here.

Stopping: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait for the replies
in flight, at most `drain_timeout` seconds, after which it cancels what is left; then the
engine shuts down and serve() returns (exit code 0). uvicorn re-raises the signal it caught
once it has stopped; the handlers installed here receive it, so the process ends by returning,
not by being killed.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from contextlib import contextmanager


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one), so the address is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextmanager
def _signals_end_quietly():
    caught = []

    def note(sig, frame):
        caught.append(sig)

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def serve(llm, *, host="127.0.0.1", port=8000, model_id="model", n_parallel=4, max_queue=64,
          prefill_chunk=256, api_key=None, cors=(), drain_timeout=30.0, quiet=False, announce=print) -> int:
    """Serves `llm` (a pyklei.LLM) until SIGTERM/SIGINT. announce(line) gets the address line
    once the socket listens."""
    import uvicorn

    from ..engine import Engine
    from .app import create_app

    engine = Engine(llm.model, llm.tokenizer, n_parallel=n_parallel, max_queue=max_queue,
                    prefill_chunk=prefill_chunk)
    n_ctx = getattr(engine, "n_ctx", llm.n_ctx)     # a sequence's context
    app = create_app(engine, llm.tokenizer, model_id, n_ctx, eos_ids=llm.eos_ids,
                     api_key=api_key, cors=cors,
                     on_shutdown=lambda: engine.shutdown(cancel=True, timeout=drain_timeout))
    sock = bind(host, port)
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=drain_timeout, lifespan="on",
                            timeout_keep_alive=5)
    server = uvicorn.Server(config)
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h
    announce(f"serving {model_id} on http://{shown}:{p}/v1 (chat page: http://{shown}:{p}/; "
             f"{n_parallel} parallel sequences, queue {max_queue})")
    sys.stdout.flush()
    if api_key is None and h not in ("127.0.0.1", "::1", "localhost"):
        print(f"pyklei serve: warning: listening on {h} without --api-key: anyone who can reach "
              f"this port can use the model", file=sys.stderr, flush=True)
    try:
        with _signals_end_quietly():
            server.run(sockets=[sock])
    finally:
        engine.shutdown(cancel=True, timeout=drain_timeout)
        sock.close()
        logging.getLogger("uvicorn.error").info("pyklei serve: stopped")
    return 0
