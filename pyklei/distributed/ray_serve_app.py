"""`pyklei serve --ray`: the same OpenAI-compatible app (pyklei.server.app) from N Ray Serve
replicas, each one pyklei engine, behind one ingress that routes each request by its prompt's
prefix (ray_serve_router.py).

    HTTP -> Ray Serve's proxy -> PykleiIngress (reads the body, computes the routing key)
         -> DeploymentHandle, PrefixAwareRequestRouter picks a replica
         -> PykleiReplica.forward: runs the request through the replica's own Starlette app
            (auth, validation, errors, streaming: as `pyklei serve`) and yields the response's
            start, then its body chunks as they come (SSE passes through chunk by chunk)

Why a separate ingress: Ray's proxy routes an HTTP request before it has read the body, so a
router behind it cannot see the prompt; the ingress reads it once and hands the replicas a
ForwardedRequest with the key (ray.llm's OpenAI ingress does the same for its LLM servers).

/metrics and /health: the ingress answers them for every running replica (the list and
their nodes from Serve's controller, each asked at once through DeploymentHandle.broadcast:
PykleiReplica.answer_whole), merged by cluster_view.py.

Nodes: the ingress holds the router's prefix tree and lives on the head node
(ray_serve_run.HEAD_NODE_RESOURCE); the replicas spread over the nodes by their CPUs.

Failures: a replica that dies fails only the requests it was serving. One that had not started
its reply gets 503 `replica_unavailable` (a client retries it and the router sends it to a live
replica); a streamed reply that was under way ends with an error event in the stream (its
headers were sent), a whole reply with a cut connection. Ray Serve restarts the replica; its
health check (check_health: the engine's scheduler alive) replaces one that hangs.

Autoscaling (deployment_options): between --min-replicas and --max-replicas on ongoing requests
per replica, with --parallel as the target (the requests a replica decodes together); Ray Serve
keeps at most --parallel + --max-queue requests on a replica and queues the rest in the router.

Cores: each replica asks Ray for --threads CPUs and pins itself to its own run of cores of its
node (its local rank's) when the node has enough of them for every replica on it.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from ..server.intake import MAX_BODY
from .cluster_view import ReplicaPlace, merge_health, merge_metrics, running_replicas
from .prefix_routing import routing_key
from .replica_errors import REPLICA_HEADER, error_response, replica_unavailable, stream_error_event

log = logging.getLogger("ray.serve")

APP_NAME = "pyklei"
REPLICA_DEPLOYMENT = "PykleiReplica"
INGRESS_DEPLOYMENT = "PykleiIngress"
HEALTH_CHECK_PERIOD_S = 10.0
HEALTH_CHECK_TIMEOUT_S = 30.0
DRAIN_S = 10.0             # a stopping replica's wait for its requests (graceful_shutdown_timeout_s)
STREAM_FLUSH_S = 0.025     # body chunks after the first, joined over this long (_coalesced)
CLUSTER_VIEW_TIMEOUT_S = 5.0   # a replica's time to answer the ingress's /metrics or /health
CLUSTER_PATHS = ("/metrics", "/health")   # answered by the ingress for every replica


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress read it; routing_key: prefix_routing.routing_key's."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    routing_key: str


def deployment_options(*, replicas: int, threads: int, n_parallel: int, max_queue: int,
                       min_replicas: int | None = None, max_replicas: int | None = None,
                       imbalance: int | None = None) -> dict:
    """The replicas' Ray Serve deployment options: a fixed number of replicas, or autoscaling
    between min_replicas and max_replicas (starting at `replicas`, clipped into that range) on
    ongoing requests, with n_parallel per replica as the target (min_replicas defaults to 1,
    max_replicas to the larger of `replicas` and min_replicas). imbalance: how many more
    queued requests a prefix holder may have than the least-loaded replica (default
    n_parallel: one batch)."""
    from ray.serve.config import RequestRouterConfig

    from .ray_serve_router import PrefixAwareRequestRouter

    opts = dict(
        max_ongoing_requests=n_parallel + max_queue,
        ray_actor_options={"num_cpus": threads},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=DRAIN_S,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRequestRouter,
            request_router_kwargs={"imbalance": n_parallel if imbalance is None else imbalance}),
    )
    if min_replicas is None and max_replicas is None:
        opts["num_replicas"] = replicas
        return opts
    lo = 1 if min_replicas is None else min_replicas
    hi = max(replicas, lo) if max_replicas is None else max_replicas
    if not 0 < lo <= hi:
        raise ValueError(f"--min-replicas ({lo}) must be at least 1 and at most --max-replicas ({hi})")
    opts["autoscaling_config"] = {
        "min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(replicas, lo), hi),
        "target_ongoing_requests": n_parallel,
        "upscale_delay_s": 5.0, "downscale_delay_s": 30.0,
    }
    return opts


def _pin_to_own_cores(threads: int) -> list[int] | None:
    """Pins this process's threads to be (the engine's, created after) to `threads` cores of
    the node, the local_rank-th run of them; None when the node has too few for that."""
    from ray import serve

    rank = serve.get_replica_context().rank
    local = getattr(rank, "local_rank", rank if isinstance(rank, int) else 0)
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[local * threads:(local + 1) * threads]
    if len(mine) < threads:
        return None
    os.sched_setaffinity(0, mine)
    return mine


class PykleiReplica:
    """One pyklei engine and the server's app over it (what `pyklei serve` would run).
    load_kwargs: pyklei.load's; engine_kwargs: pyklei.server.run.served_model's; app_kwargs:
    pyklei.server.app.create_app's."""

    def __init__(self, model_id: str, load_kwargs: dict, engine_kwargs: dict, app_kwargs: dict):
        import ray
        from ray import serve

        from ..llm import load
        from ..server.app import create_app
        from ..server.model_registry import ModelRegistry
        from ..server.run import served_model

        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        cores = _pin_to_own_cores(load_kwargs.get("n_threads") or 1)
        log.info("pyklei replica %s: cores %s", self.name, cores or "not pinned (too few)")
        llm = load(**load_kwargs)
        self.model = served_model(model_id, llm, **engine_kwargs)
        self.models = ModelRegistry.of_one(self.model)
        self.app = create_app(models=self.models, **app_kwargs)

    def check_health(self):
        """Ray Serve calls this every HEALTH_CHECK_PERIOD_S: an engine whose scheduler thread
        ended cannot answer, so the replica is replaced."""
        if not self.model.engine.scheduler_alive:
            raise RuntimeError(f"replica {self.name}: the engine's scheduler has stopped")

    def __del__(self):
        try:
            self.models.shutdown(cancel=True, timeout=DRAIN_S)
        except Exception:
            pass

    async def answer_whole(self, req: ForwardedRequest) -> dict:
        """`req`'s whole answer with this replica's id and node: {"replica", "node", "status",
        "body"} (the ingress's /metrics and /health, broadcast to every replica)."""
        status, body = None, bytearray()
        async for part in self.forward(req):
            if isinstance(part, dict):
                status = part["status"]
            else:
                body += part
        return {"replica": self.name, "node": self.node, "status": status, "body": bytes(body)}

    async def forward(self, req: ForwardedRequest):
        """Runs `req` through the app: yields {"status", "headers", "replica"} once, then the
        body's chunks (bytes) as the app sends them. Cancelled (the client left): the app sees
        http.disconnect, which cancels its sequence in the engine."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive():
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": req.method, "scheme": "http",
                 "path": req.path, "raw_path": req.path.encode(), "root_path": "",
                 "query_string": req.query_string, "headers": req.headers,
                 "client": req.client, "server": None, "state": {}}
        app = asyncio.create_task(self.app(scope, receive, sent.put))
        app.add_done_callback(lambda t: sent.put_nowait(None))
        try:
            async for part in _coalesced(sent, STREAM_FLUSH_S):
                if isinstance(part, dict):
                    yield {"status": part["status"], "headers": list(part.get("headers", [])),
                           "replica": self.name}
                else:
                    yield part
        finally:
            gone.set()
            try:
                await asyncio.wait_for(app, DRAIN_S)
            except BaseException:     # the app's own errors were answered (500) already
                pass


async def _coalesced(sent: asyncio.Queue, flush_s: float):
    """The app's ASGI messages from `sent` (None: the app ended) as the replica streams them:
    the response's start, its first body chunk at once (the time to first token), then the
    later chunks joined: each pending chunk goes out at most flush_s after it came (with those
    behind it), and the end sends what is pending. Each item crossing Ray costs about 1.6 ms
    of the ingress's CPU and 1.1 ms of the proxy's (measured here): one per token at a
    decode step's pace took a quarter of a core on a 2-core machine, and the engines' share
    with it. Chunks are whole SSE events, so a joined one is a valid stream."""
    pending: list[bytes] = []
    getter, flush_at, first = None, None, True
    loop = asyncio.get_running_loop()
    try:
        while True:
            # one get outstanding at a time: waiting on it with a timeout never drops a message
            getter = getter or asyncio.ensure_future(sent.get())
            wait = None if flush_at is None else max(0.0, flush_at - loop.time())
            done, _ = await asyncio.wait({getter}, timeout=wait)
            if not done:                                     # flush_s since the oldest pending
                yield b"".join(pending)
                pending, flush_at = [], None
                continue
            msg, getter = getter.result(), None
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                yield msg
            elif msg["type"] == "http.response.body":
                if body := msg.get("body"):
                    if first:
                        first = False
                        yield bytes(body)
                    else:
                        pending.append(bytes(body))
                        flush_at = flush_at or loop.time() + flush_s
                if not msg.get("more_body", False):
                    break
        if pending:
            yield b"".join(pending)
    finally:
        if getter is not None:
            getter.cancel()


class PykleiIngress:
    """Reads each request, computes its routing key and passes it to the replicas (their
    router picks one); streams the replica's answer back with REPLICA_HEADER added. GET
    /metrics and /health it answers itself for every running replica (cluster_view.py)."""

    def __init__(self, replicas):
        self.handle = replicas
        self.replicas = replicas.options(method_name="forward", stream=True)

    async def _running_replicas(self) -> list[ReplicaPlace]:
        """The replicas the Serve controller reports running (the list serve.status() reads)."""
        import ray
        from ray import serve
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        details = await controller.get_serve_instance_details.remote()
        return running_replicas(details, serve.get_replica_context().app_name,
                                REPLICA_DEPLOYMENT)

    async def _every_replica(self, fwd: ForwardedRequest):
        """(the running replicas, {replica id: its answer to `fwd`}): every replica asked at
        once (Ray Serve's broadcast, past the router and its queues), all held to
        CLUSTER_VIEW_TIMEOUT_S; one that died or did not answer in time is named, not awaited."""
        from ray.serve.exceptions import DeploymentUnavailableError

        places = {p.replica: p for p in await self._running_replicas()}
        answers: dict[str, bytes | str] = {}
        missing = "did not answer"
        try:
            results = await self.handle.broadcast("answer_whole", fwd).results_async(
                timeout_s=CLUSTER_VIEW_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:       # the broadcast is one wait: no replica's answer is kept
            results, missing = [], f"no answer within {CLUSTER_VIEW_TIMEOUT_S:g} s"
        except DeploymentUnavailableError:
            results = []
        for r in results:
            if isinstance(r, dict):    # else the exception of a replica that died meanwhile
                places.setdefault(r["replica"], ReplicaPlace(r["replica"], r["node"]))
                answers[r["replica"]] = r["body"] if r["status"] == 200 else f"HTTP {r['status']}"
        for replica in places:
            answers.setdefault(replica, missing)
        return sorted(places.values(), key=lambda p: p.replica), answers

    async def _cluster_view(self, fwd: ForwardedRequest):
        from prometheus_client.exposition import CONTENT_TYPE_LATEST
        from starlette.responses import JSONResponse, Response

        if not hasattr(self.handle, "broadcast"):      # Ray Serve before its broadcast API
            import ray
            return error_response(fwd.path, 501, f"Ray Serve {ray.__version__} has no DeploymentHandle."
                          f"broadcast: upgrade Ray for the replicas' {fwd.path}", "server_error",
                          "not_implemented")
        places, answers = await self._every_replica(fwd)
        if fwd.path == "/metrics":
            return Response(merge_metrics(places, answers), media_type=CONTENT_TYPE_LATEST)
        status, body = merge_health(places, answers)
        return JSONResponse(body, status_code=status)

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        body = bytearray()
        async for chunk in request.stream():     # the server's own limit, before any replica
            body += chunk
            if len(body) > MAX_BODY:
                return error_response(request.url.path, 413, f"the body must be at most {MAX_BODY} "
                              f"bytes", "invalid_request_error", None)
        body = bytes(body)
        headers = {k.lower(): v for k, v in request.headers.items()}
        # the app's own paths: without the application's route prefix (ASGI's root_path)
        path, root = request.scope["path"], request.scope.get("root_path", "")
        path = path[len(root):] or "/" if root and path.startswith(root) else path
        fwd = ForwardedRequest(request.method, path, request.url.query.encode(),
                               list(request.headers.raw), body,
                               tuple(request.client) if request.client else None,
                               routing_key(path, body, headers))
        if request.method == "GET" and path in CLUSTER_PATHS:
            return await self._cluster_view(fwd)
        stream = self.replicas.remote(fwd)
        try:
            start = await stream.__anext__()
        except Exception as e:
            log.warning("pyklei ingress: %s %s failed before its reply: %s", fwd.method, fwd.path, e)
            return replica_unavailable(fwd.path, e)
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                  for k, v in start["headers"])

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:      # the replica died mid-reply: this request alone fails
                log.warning("pyklei ingress: replica %s failed mid-reply: %s", start["replica"], e)
                if not sse:
                    raise
                yield stream_error_event(fwd.path, e)
            finally:
                stream.cancel()

        out = StreamingResponse(rest(), status_code=start["status"])
        out.raw_headers = [*start["headers"], (REPLICA_HEADER.encode(), start["replica"].encode())]
        return out
