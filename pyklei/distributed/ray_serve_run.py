"""Runs `pyklei serve --ray`: joins or starts the Ray cluster (ray_connect.py), deploys
the ingress and the replicas (ray_serve_app.py) under Ray Serve's HTTP proxy on --host:--port,
and holds them until SIGTERM or Ctrl-C, then takes the application down (each replica drains
for ray_serve_app.DRAIN_S) and leaves the cluster (a local one stops with it)."""
from __future__ import annotations

import signal
import socket
import sys
import threading

from .ray_serve_app import (APP_NAME, INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, PykleiIngress,
                            PykleiReplica, deployment_options)
from .ray_connect import RayUnavailable, connect

# a resource only the head node has (Ray's own ray._common.constants.HEAD_NODE_RESOURCE_NAME;
# Ray Train pins its state actor with it the same way)
HEAD_NODE_RESOURCE = "node:__internal_head__"


def build_application(*, model_id: str, load_kwargs: dict, engine_kwargs: dict,
                      app_kwargs: dict, replicas: int, min_replicas=None, max_replicas=None,
                      imbalance=None):
    """The Serve application: PykleiIngress over `replicas` PykleiReplicas (or autoscaled
    between min_replicas and max_replicas), each pyklei.load(**load_kwargs) with
    served_model(**engine_kwargs) and create_app(**app_kwargs)."""
    from ray import serve

    threads = load_kwargs.get("n_threads") or 1
    replica = serve.deployment(PykleiReplica, name=REPLICA_DEPLOYMENT).options(
        **deployment_options(replicas=replicas, threads=threads,
                             n_parallel=engine_kwargs["n_parallel"],
                             max_queue=engine_kwargs["max_queue"], min_replicas=min_replicas,
                             max_replicas=max_replicas, imbalance=imbalance))
    # the ingress only reads bodies and passes bytes on: no CPU of the replicas' reserved.
    # It holds the router's prefix tree, so it lives on the head node (as Serve's controller
    # does): losing a worker node loses that node's replicas, never the routing of the rest
    ingress = serve.deployment(PykleiIngress, name=INGRESS_DEPLOYMENT,
                               ray_actor_options={"num_cpus": 0,
                                                  "resources": {HEAD_NODE_RESOURCE: 0.001}},
                               max_ongoing_requests=1 << 16)
    return ingress.bind(replica.bind(model_id, load_kwargs, engine_kwargs, app_kwargs))


def _last_error_line(message: str) -> str:
    """The exception line at the end of a traceback Ray puts in its message."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    return lines[-1] if lines else "no reason given"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_on_ray(*, ray_address: str | None, host: str, port: int, announce=print,
                 **application) -> int:
    """Serves build_application(**application) on http://host:port until SIGTERM/SIGINT
    (port 0: a free one); returns the exit code."""
    ray = connect(ray_address, part="serve", what="pyklei serve --ray")
    from ray import serve

    port = port or _free_port(host)
    stop = threading.Event()
    deployed = False
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        if ray_address and APP_NAME in serve.status().applications:
            # serve.run would redeploy it: another user's server would become this one
            raise RayUnavailable(f"the Ray cluster at {ray_address} already serves an application "
                                 f"named {APP_NAME!r} (another pyklei serve --ray); stop it first")
        deployed = True
        try:
            serve.run(build_application(**application), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:        # a replica's constructor failed: Ray's message, short
            raise RayUnavailable(f"the replicas did not start: "
                                 f"{_last_error_line(str(e))}") from None
        n = application["replicas"]
        lo, hi = application.get("min_replicas"), application.get("max_replicas")
        scale = f"{n} replicas" if lo is None and hi is None else \
            f"{n} replicas (autoscaled {lo or n}..{hi or n})"
        shown = f"[{host}]" if ":" in host else host
        announce(f"serving {application['model_id']} on http://{shown}:{port}/v1 from {scale} "
                 f"on Ray ({ray.get_runtime_context().gcs_address}), routed by prompt prefix")
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if ray_address:
            # a cluster others may use: this application alone goes (its replicas drain, then
            # stop); Serve's controller, proxies and other applications stay
            if deployed:
                serve.delete(APP_NAME)
        else:
            serve.shutdown()       # the cluster this command started: everything goes
        ray.shutdown()
    return 0
