"""`pyklei route`: one OpenAI-compatible endpoint in front of several `pyklei serve` replicas,
without Ray. Each request goes to the replica that served the previous turn of its
conversation, unless that one is `imbalance` requests busier than the least-loaded; a new
conversation goes to the replica holding the fewest (prefix_routing.py: the rule `serve
--ray`'s router follows too).

    pyklei serve model.gguf --port 8001 &  pyklei serve model.gguf --port 8002 &
    pyklei route http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8080

Why beside nginx (examples/nginx-replicas.conf): nginx spreads the load but not the state.
Round-robin and least_conn send a conversation's next turn to any replica, which then
prefills the whole conversation again. Why beside `serve --ray`: Ray's proxy and the ingress
behind it are two hops and a few tens of milliseconds of CPU per request (docs/SERVE.md). Here
it is one process and one hop, and the replicas are plain servers anywhere on the network.

Load: the router forwards every request, so it knows each replica's requests in flight without
asking. Health: every HEALTH_PERIOD_S it asks each replica's /health; one that does not answer
200 gets no new request and its conversations leave the tree (they start afresh elsewhere).
When it answers again it is used again. A request whose connection to its replica cannot be
opened (nothing was sent), or that its replica did not take (429: its queue is full; 503: it is
shutting down), goes to the next one; a replica that fails once the request was sent fails that
request alone (replica_errors.py: 503 before the reply, an error event in a stream).

The router's own /health and /metrics describe the replicas as it sees them; each replica's
engine metrics stay at that replica's /metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..server.intake import MAX_BODY
from .prefix_routing import PrefixTree, choose_replicas, routing_key
from .replica_errors import REPLICA_HEADER, error_response, replica_unavailable, stream_error_event

log = logging.getLogger("uvicorn.error")

HEALTH_PERIOD_S = 5.0       # each replica's /health is asked this often
HEALTH_TIMEOUT_S = 3.0      # ... and counted down when it has not answered 200 in this long
CONNECT_TIMEOUT_S = 5.0     # opening a connection to a replica
# a replica's answers that say it did not take the request (its queue full, or it is shutting
# down or loading another model): the request goes to the next replica, as examples/nginx-
# replicas.conf's proxy_next_upstream does; from the last one, its answer is the reply
NOT_TAKEN = frozenset({429, 503})
# not passed on either way: they describe one connection, not the message (RFC 9110, 7.6.1)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
# nor, of a request, Host (it names the router: the replica gets its own, so its allowed-host
# check holds) and Content-Length (httpx sets both)
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}


def replica_url(text: str) -> str:
    """A replica's base URL, http(s)://host:port (a trailing / or /v1 dropped); ValueError
    naming what is wrong otherwise."""
    url = text.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not a replica's URL: expected http://HOST:PORT")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"{text!r}: the port is not a number from 0 to 65535") from None
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"{text!r}: a replica's URL has no path (give http://HOST:PORT)")
    return url


@dataclass(eq=False)        # a replica is itself: its identity keys the tree
class Replica:
    url: str
    in_flight: int = 0       # requests forwarded and not yet answered in full
    up: bool = True          # its /health answered 200 last time (or it was never asked)
    requests: int = 0        # requests it was sent
    failures: int = 0        # requests that failed on it


class Router:
    """The replicas, what each was sent (a PrefixTree) and the choice for a new request."""

    def __init__(self, urls: list[str], imbalance: int):
        self.replicas = [Replica(u) for u in urls]
        self.tree = PrefixTree()
        self.imbalance = imbalance
        self.decisions = {"prefix": 0, "least_loaded": 0}

    def ranked(self, key: str) -> list[Replica]:
        """Every replica in the order to try them for a request with this routing key: the
        chosen one (recorded in the tree as sent `key`), then the others that are up, least
        loaded first, then those that are down (one may have come back since it was asked)."""
        live = [r for r in self.replicas if r.up] or self.replicas
        chosen, why = choose_replicas(self.tree, key, {r: r.in_flight for r in live},
                                      self.imbalance)
        self.decisions[why] += 1
        pick = random.choice(chosen)
        if key:
            self.tree.insert(key, pick)
        rest = sorted((r for r in self.replicas if r is not pick),
                      key=lambda r: (not r.up, r.in_flight))
        return [pick, *rest]

    def mark(self, replica: Replica, up: bool, why: str = "") -> None:
        if replica.up and not up:
            self.tree.remove(replica)     # its conversations start afresh where they land
            log.warning("pyklei route: replica %s is down (%s)", replica.url, why)
        elif up and not replica.up:
            log.warning("pyklei route: replica %s is back", replica.url)
        replica.up = up

    async def check_health(self, client) -> None:
        """Asks every replica's /health at once and marks each up or down."""
        async def one(r: Replica):
            try:
                resp = await client.get(r.url + "/health", timeout=HEALTH_TIMEOUT_S)
                self.mark(r, resp.status_code == 200, f"/health answered {resp.status_code}")
            except Exception as e:           # refused, timed out, reset: not reachable
                self.mark(r, False, f"/health: {type(e).__name__}")
        await asyncio.gather(*(one(r) for r in self.replicas))


def _forwarded_headers(request) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in request.headers.raw
           if k.lower().decode("latin-1") not in NOT_FORWARDED]
    if request.client:
        prior = request.headers.get("x-forwarded-for")
        out = [(k, v) for k, v in out if k.lower() != b"x-forwarded-for"]
        out.append((b"x-forwarded-for",
                    f"{prior}, {request.client[0]}".encode() if prior else request.client[0].encode()))
    return out


def create_router_app(urls: list[str], *, imbalance: int = 4, allowed_hosts=None,
                      health_period_s: float = HEALTH_PERIOD_S):
    """The router's Starlette app over these replica base URLs (replica_url's form).
    allowed_hosts: the Host header names it answers (None: any), as `pyklei serve`'s."""
    import httpx
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    router = Router(urls, imbalance)
    state = {}

    class Relay(StreamingResponse):
        """The replica's response passed on as its bytes come; whatever way it ends (done,
        the client gone, the replica failing), the upstream response closes and the replica's
        count drops."""

        def __init__(self, upstream, replica: Replica, path: str):
            self.upstream, self.replica, self.path = upstream, replica, path
            self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            super().__init__(self._chunks(), status_code=upstream.status_code)
            self.raw_headers = [(k, v) for k, v in upstream.headers.raw
                                if k.lower().decode("latin-1") not in HOP_BY_HOP]
            self.raw_headers.append((REPLICA_HEADER.encode(), replica.url.encode()))

        async def _chunks(self):
            try:
                async for chunk in self.upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:     # the replica failed mid-reply: this request alone
                self.replica.failures += 1
                log.warning("pyklei route: replica %s failed mid-reply: %s", self.replica.url, e)
                if not self.sse:
                    raise                    # a whole reply: the connection is cut
                yield stream_error_event(self.path, e)

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.upstream.aclose()
                self.replica.in_flight -= 1

    async def forward(request):
        body = bytearray()
        async for chunk in request.stream():        # the servers' own limit, before any replica
            body += chunk
            if len(body) > MAX_BODY:
                return error_response(request.url.path, 413, f"the body must be at most "
                                      f"{MAX_BODY} bytes", "invalid_request_error", None)
        path = request.url.path
        headers = {k.lower(): v for k, v in request.headers.items()}
        key = routing_key(path, bytes(body), headers) if request.method == "POST" else ""
        target = path + (f"?{request.url.query}" if request.url.query else "")
        out_headers = _forwarded_headers(request)
        client = state["client"]
        ranked = router.ranked(key)
        for i, r in enumerate(ranked):
            r.in_flight += 1
            r.requests += 1
            try:
                upstream = await client.send(
                    client.build_request(request.method, r.url + target, headers=out_headers,
                                         content=bytes(body)), stream=True)
                if upstream.status_code in NOT_TAKEN and i + 1 < len(ranked):
                    await upstream.aclose()
                    r.in_flight -= 1
                    if key:
                        router.tree.insert(key, ranked[i + 1])
                    continue
                return Relay(upstream, r, path)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:   # nothing was sent
                r.in_flight -= 1
                r.failures += 1
                router.mark(r, False, f"connecting: {type(e).__name__}")
                if key and i + 1 < len(ranked):
                    router.tree.insert(key, ranked[i + 1])
            except httpx.HTTPError as e:   # sent, no reply: it may have run, so not resent
                r.in_flight -= 1
                r.failures += 1
                log.warning("pyklei route: %s %s failed on %s: %s", request.method, path, r.url, e)
                return replica_unavailable(path, e)
        return replica_unavailable(path, message=f"no replica could be reached "
                                   f"({', '.join(r.url for r in ranked)}); retry later")

    def replicas_view():
        return [{"url": r.url, "up": r.up, "in_flight": r.in_flight, "requests": r.requests,
                 "failures": r.failures} for r in router.replicas]

    async def health(request):
        up = any(r.up for r in router.replicas)
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas": replicas_view()},
                            status_code=200 if up else 503)

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(_metrics_text(router), media_type=CONTENT_TYPE_LATEST)

    async def watch_health():
        while True:
            await asyncio.sleep(health_period_s)
            await router.check_health(state["client"])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False)
        await router.check_health(state["client"])
        watcher = asyncio.create_task(watch_health())
        try:
            yield
        finally:
            watcher.cancel()
            await state["client"].aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)] \
        if allowed_hosts is not None else []
    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/metrics", metrics, methods=["GET"]),
                            Route("/{path:path}", forward, methods=methods)],
                    middleware=middleware, lifespan=lifespan)
    app.state.router = router
    return app


def _metrics_text(router: Router) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            up = GaugeMetricFamily("pyklei_route_replica_up", "1 when the replica's last "
                                   "/health answered 200", labels=["replica"])
            busy = GaugeMetricFamily("pyklei_route_replica_in_flight", "requests forwarded to "
                                     "the replica and not yet answered in full", labels=["replica"])
            sent = CounterMetricFamily("pyklei_route_replica_requests", "requests sent to the "
                                       "replica", labels=["replica"])
            failed = CounterMetricFamily("pyklei_route_replica_failures", "requests that failed "
                                         "on the replica", labels=["replica"])
            for r in router.replicas:
                up.add_metric([r.url], float(r.up))
                busy.add_metric([r.url], r.in_flight)
                sent.add_metric([r.url], r.requests)
                failed.add_metric([r.url], r.failures)
            why = CounterMetricFamily("pyklei_route_decisions", "routing decisions: to the "
                                      "replica holding the conversation (prefix) or the least "
                                      "loaded", labels=["decision"])
            for k, v in router.decisions.items():
                why.add_metric([k], v)
            yield from (up, busy, sent, failed, why)

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry)


def run_router(urls: list[str], *, host: str = "127.0.0.1", port: int = 8080, imbalance: int = 4,
               quiet: bool = False, announce=print) -> int:
    """Routes requests on host:port (0: a free port) over these replicas until SIGTERM or
    Ctrl-C (replies in flight get `pyklei serve`'s default --drain-timeout); returns the exit
    code. Connections are held to `pyklei serve`'s defaults (transport.py)."""
    import uvicorn

    from ..runtime.options import SERVER_OPTION, default
    from ..server.run import _signals_end_quietly, allowed_host_names
    from ..server.transport import bind, protocol_class

    drain_timeout = default(SERVER_OPTION, "drain_timeout")

    app = create_router_app(urls, imbalance=imbalance, allowed_hosts=allowed_host_names(host))
    sock = bind(host, port)
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not quiet,
                            lifespan="on", timeout_graceful_shutdown=drain_timeout,
                            timeout_keep_alive=default(SERVER_OPTION, "timeout_idle"),
                            http=protocol_class(default(SERVER_OPTION, "timeout_header"),
                                                default(SERVER_OPTION, "max_connections"),
                                                MAX_BODY))
    server = uvicorn.Server(config)
    h, p = sock.getsockname()[:2]
    shown = f"[{h}]" if ":" in h else h
    try:
        with _signals_end_quietly(lambda: setattr(server, "should_exit", True)):
            announce(f"routing http://{shown}:{p}/v1 over {len(urls)} replicas "
                     f"({', '.join(urls)}) by conversation")
            sys.stdout.flush()
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
