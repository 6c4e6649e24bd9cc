"""pyklei on several machines: replicas routed by conversation, on Ray (the `ray` extra, pip
install -e '.[ray]') or behind `pyklei route` (the `serve` extra); docs/SERVE.md, docs/BATCH.md.

    prefix_routing.py      which replica holds a prompt's prefix: the routing key, a radix tree
                           per replica, the choice (no Ray: unit-tested alone)
    http_router.py         `pyklei route`: that choice in front of plain `pyklei serve`s (no Ray)
    replica_errors.py      a failed replica's answers and the x-pyklei-replica header, for both
    ray_serve_router.py    that choice behind Ray Serve's request-router API
    ray_serve_app.py       the ingress and the replicas (each one engine and the server's app)
    cluster_view.py        the whole deployment's /metrics and /health from each replica's own
                           (no Ray: unit-tested alone)
    ray_serve_run.py       `pyklei serve --ray`: deploy, hold until SIGTERM, take down
    ray_connect.py         the one way onto a cluster, for serve --ray and batch --ray: the
                           extra (Ray Serve or Ray Data), the address and its deadline, a local
                           cluster, one-line failures (RayUnavailable)
"""
