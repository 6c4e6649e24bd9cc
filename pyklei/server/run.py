"""Runs the server: its models (each with its own engine; model_registry.py), one uvicorn
server on a socket bound here.

Stopping: SIGTERM or Ctrl-C makes uvicorn stop accepting connections and wait for the replies
in flight. At `drain_timeout` seconds the engines cancel what is left, so every reply still
running ends properly (a last chunk with finish_reason "cancelled", then [DONE]) rather than
being cut; uvicorn's own deadline, a few seconds later, is only a backstop. Then the engines
shut down and serve() returns (exit code 0). uvicorn re-raises the signal it caught once it
has stopped; the handlers installed here receive it, so the process ends by returning, not by
being killed.

Connections: transport.py (TCP_NODELAY, the header deadline, the connection cap and the
open-file limit); `timeout_idle` closes kept-alive connections with no request (uvicorn's
timeout_keep_alive); `timeout_body` bounds a request body's upload and `timeout_write` a
streamed reply's wait for its client to read (app.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from contextlib import contextmanager

from ..runtime.options import ENGINE_OPTION, SERVER_OPTION, check_options, default
from .model_registry import ModelRegistry, ServedModel
from .transport import bind, open_file_budget, protocol_class, quiet_accept_errors

DRAIN_BACKSTOP_S = 10.0    # uvicorn cancels tasks this long after our own drain deadline
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@contextmanager
def _signals_end_quietly(stop):
    """SIGTERM/SIGINT call stop() instead of killing the process: one that comes after the
    address line but before uvicorn installs its own handlers must still stop the server."""
    caught = []

    def note(sig, frame):
        caught.append(sig)
        stop()

    old = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _draining_server(config, drain_timeout: float, on_deadline):
    """A uvicorn.Server whose graceful shutdown calls on_deadline() after drain_timeout s, and
    whose event loop logs running out of descriptors in one line (transport.py)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None):
            quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)

        async def shutdown(self, sockets=None):
            deadline = asyncio.get_running_loop().call_later(drain_timeout, on_deadline)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    return DrainingServer(config)


_E, _S = ENGINE_OPTION, SERVER_OPTION


def allowed_host_names(host: str, allow_hosts=()) -> list[str] | None:
    """The Host header names a server listening on `host` answers (app.create_app's
    allowed_hosts): the loopback names and allow_hosts on a loopback address or when names
    are given; None (any) otherwise."""
    if host in LOOPBACK or allow_hosts:
        return list(LOOPBACK) + [host] + list(allow_hosts)
    return None


def served_model(model_id, llm, *, n_parallel=default(_E, "n_parallel"),
                 max_queue=default(_E, "max_queue"), prefill_chunk=default(_E, "prefill_chunk"),
                 speculative=None, drain_timeout=default(_S, "drain_timeout"),
                 cache_ram=default(_E, "cache_ram"), cache_dir=None,
                 cache_disk=default(_E, "cache_disk")) -> ServedModel:
    """`llm` (a pyklei.LLM) with its engine, as the app serves it under model_id (also each
    replica of `pyklei serve --ray`: pyklei.distributed.ray_serve_app); cache_*: the engine's
    prefix cache (serve's)."""
    from ..runtime.engine import Engine

    engine = Engine(llm.model, llm.tokenizer, n_parallel=n_parallel, max_queue=max_queue,
                    prefill_chunk=prefill_chunk, speculative=speculative,
                    cache_ram=cache_ram, cache_dir=cache_dir, cache_disk=cache_disk)
    if cache_ram and engine.prefix_cache is None:
        from ..runtime.prefix_cache import cacheable
        print(f"pyklei serve: note: {model_id} runs without a prefix cache: "
              f"{cacheable(llm.model)}", file=sys.stderr, flush=True)

    def close():           # unloaded to make room for another model: it is idle
        engine.shutdown(cancel=True, timeout=drain_timeout)
        llm.close()

    return ServedModel(model_id, engine, llm.tokenizer,
                       getattr(engine, "n_ctx", llm.n_ctx), close)   # a sequence's context


def serve(llm, *, host="127.0.0.1", port=default(_S, "port"), model_id="model",
          n_parallel=default(_E, "n_parallel"), max_queue=default(_E, "max_queue"),
          prefill_chunk=default(_E, "prefill_chunk"), api_key=None, cors=(),
          drain_timeout=default(_S, "drain_timeout"), quiet=False,
          timeout_header=default(_S, "timeout_header"), timeout_body=default(_S, "timeout_body"),
          timeout_write=default(_S, "timeout_write"), timeout_idle=default(_S, "timeout_idle"),
          max_connections=default(_S, "max_connections"), allow_hosts=(), announce=print,
          speculative=None, special_in_content=False, loaders=None,
          models_max=default(_S, "models_max"), cache_ram=default(_E, "cache_ram"),
          cache_dir=None, cache_disk=default(_E, "cache_disk")) -> int:
    """Serves `llm` (a pyklei.LLM) until SIGTERM/SIGINT. loaders: several models instead (llm
    None), {model id: a function that loads that pyklei.LLM}: model_id's is loaded now (the
    default model), each other one on the first request that names it in its `model` field,
    at most `models_max` resident (model_registry.py). Without loaders every request gets
    `llm`, whatever it names. The numbers' defaults and ranges are
    pyklei.runtime.options' ENGINE_OPTIONS and SERVER_OPTIONS. announce(line) gets the address line
    once the socket listens. allow_hosts: Host header names accepted besides the loopback
    names (app.create_app). speculative: "lookup" drafts every request by prompt lookup, a
    draft model (pyklei.load(small, n_seq=n_parallel)) with it (pyklei.runtime.engine). api_key: a
    key or a list of keys, each a tenant (app.create_app). special_in_content: special-token
    text in chat messages is read as control tokens (off: as text;
    Tokenizer.apply_chat_template's parse_special_in_content). cache_ram (MB; 0: off), cache_dir,
    cache_disk (MB): each engine's prefix cache (pyklei.runtime.prefix_cache; several models
    under one cache_dir keep their blocks apart)."""
    import uvicorn

    from .app import create_app
    from .intake import MAX_BODY

    check_options(_S, port=port, drain_timeout=drain_timeout, max_connections=max_connections,
                  timeout_header=timeout_header, timeout_body=timeout_body,
                  timeout_write=timeout_write, timeout_idle=timeout_idle, models_max=models_max)
    budget = open_file_budget()
    if budget < max_connections:
        print(f"pyklei serve: warning: the open-file limit allows {max(budget, 0)} connections, "
              f"fewer than --max-connections {max_connections}", file=sys.stderr, flush=True)
        max_connections = max(budget, 1)

    def served(model_id, llm) -> ServedModel:
        return served_model(model_id, llm, n_parallel=n_parallel, max_queue=max_queue,
                            prefill_chunk=prefill_chunk, speculative=speculative,
                            drain_timeout=drain_timeout, cache_ram=cache_ram, cache_dir=cache_dir,
                            cache_disk=cache_disk)

    if loaders is not None:
        if llm is not None or model_id not in loaders:
            raise ValueError(f"with loaders, llm is None and model_id ({model_id!r}) one of them")
        models = ModelRegistry(models_max)
        for mid in [model_id] + [m for m in loaders if m != model_id]:    # the default first
            # the registry alone refers to a loaded model, so that unloading it frees it all
            models.add(mid, lambda mid=mid: served(mid, loaders[mid]()),
                       loaded=served(mid, loaders[mid]()) if mid == model_id else None)
    else:
        models = ModelRegistry.of_one(served(model_id, llm))
    app = create_app(models=models, api_key=api_key, cors=cors,
                     body_timeout=timeout_body, write_timeout=timeout_write,
                     allowed_hosts=allowed_host_names(host, allow_hosts),
                     on_shutdown=lambda: models.shutdown(cancel=True, timeout=drain_timeout),
                     special_in_content=special_in_content)
    sock = bind(host, port)
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=drain_timeout + DRAIN_BACKSTOP_S,
                            lifespan="on", timeout_keep_alive=timeout_idle,
                            http=protocol_class(timeout_header, max_connections, MAX_BODY))
    server = _draining_server(config, drain_timeout,
                              lambda: models.shutdown(cancel=True, timeout=0))
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h
    try:
        # the handlers first: a signal sent as soon as the address line is read must find them
        with _signals_end_quietly(lambda: setattr(server, "should_exit", True)):
            what = model_id if loaders is None else (
                f"{len(loaders)} models ({', '.join(loaders)}; default {model_id}, at most "
                f"{models_max} loaded)")
            announce(f"serving {what} on http://{shown}:{p}/v1 (chat page: "
                     f"http://{shown}:{p}/; {n_parallel} parallel sequences, queue {max_queue})")
            sys.stdout.flush()
            if api_key is None and h not in ("127.0.0.1", "::1", "localhost"):
                print(f"pyklei serve: warning: listening on {h} without --api-key: anyone who "
                      f"can reach this port can use the model", file=sys.stderr, flush=True)
            server.run(sockets=[sock])
    finally:
        models.shutdown(cancel=True, timeout=drain_timeout)
        sock.close()
        logging.getLogger("uvicorn.error").info("pyklei serve: stopped")
    return 0
