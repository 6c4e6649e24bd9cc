"""`pyklei route`: one endpoint in front of several `pyklei serve` replicas, each request sent
to the replica holding its conversation (pyklei.distributed.http_router; docs/SERVE.md)."""
from __future__ import annotations

import importlib

from ._common import CLIError, _add_command, _int_at_least
from .serve import SERVE_EXTRA_MODULES

ROUTE_EXTRA_MODULES = (*SERVE_EXTRA_MODULES, "httpx")   # the `serve` extra's, as serve.py's


def add_parser(sub):
    from ..runtime.options import ENGINE_OPTION, default

    p = _add_command(
        sub, "route", "route requests over several `pyklei serve` replicas by conversation",
        "Listen on --host:--port and pass each request on to one of the REPLICA servers "
        "(`pyklei serve`, anywhere on the network), its reply streamed back as it comes. A "
        "conversation's next turn goes to the replica that served its previous one, which "
        "still holds its prompt (only the new tokens are prefilled there), unless that replica "
        "has --imbalance more requests in flight than the least-loaded; a new conversation goes "
        "to the replica holding the fewest. Replicas are asked for /health every few seconds; "
        "one that does not answer gets no requests until it does. The router's own /health "
        "and /metrics describe the replicas as it sees them.",
        epilog="examples:\n"
               "  pyklei route http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8080\n"
               "  pyklei route http://10.0.0.5:8000 http://10.0.0.6:8000 --host 0.0.0.0\n"
               "\ndocs/SERVE.md: several replicas, routing by conversation.")
    p.add_argument("replicas", metavar="REPLICA", nargs="+",
                   help="a replica's base URL, http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=_int_at_least(0, "port", 65535), default=8080,
                   help="port to listen on (default %(default)s, examples/nginx-replicas.conf's; "
                        "0: a free one)")
    p.add_argument("--imbalance", type=_int_at_least(0, "imbalance"),
                   default=default(ENGINE_OPTION, "n_parallel"), metavar="N",
                   help="how many more requests in flight the replica holding a conversation may "
                        "have than the least-loaded one before the turn goes elsewhere (default "
                        "%(default)s, `pyklei serve`'s default --parallel: one batch)")
    p.add_argument("--quiet", action="store_true", help="no request log")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        for name in ROUTE_EXTRA_MODULES:
            importlib.import_module(name)
    except ImportError as e:
        raise CLIError(f"the router needs the 'serve' extra (in a pyklei checkout: pip install "
                       f"-e '.[serve]'): {e}") from None
    from ..distributed.http_router import replica_url, run_router

    urls = []
    for text in args.replicas:
        try:
            url = replica_url(text)
        except ValueError as e:
            raise CLIError(str(e)) from None
        if url in urls:
            raise CLIError(f"replica {url} is given twice")
        urls.append(url)
    return run_router(urls, host=args.host, port=args.port, imbalance=args.imbalance,
                      quiet=args.quiet)
