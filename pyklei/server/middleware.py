"""The app's ASGI middleware: the Host header check (DNS rebinding) and the count of requests by
endpoint and status, which also releases the model leases a request took (app._for_model) once
its response has been sent entirely, streamed replies included.
"""
from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from . import openai_api as api
from .metrics import Metrics

CLIENT_CLOSED = 499            # nginx's status for "the client closed the request"
LEASES = "pyklei.leases"       # scope key: the model leases a request holds (CountRequests)


def error_response(e: api.APIError, headers=None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class CountRequests:
    """ASGI middleware: pyklei_requests_total by endpoint and the status actually sent; then
    releases the request's model leases (scope[LEASES])."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [CLIENT_CLOSED]     # nothing sent: the client left first
        leases = scope[LEASES] = []  # _for_model's: released once the response is sent

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            status[0] = 500            # answered by Starlette's outermost error handler
            raise
        finally:
            for lease in leases:
                lease.release()
            self.metrics.request(scope["path"], status[0])
            if status[0] == CLIENT_CLOSED:
                _log_abandoned(scope)


def _log_abandoned(scope) -> None:
    """An access-log line for a request whose client left before the answer: uvicorn logs only
    responses it sent. Same logger and shape as uvicorn's lines."""
    access = logging.getLogger("uvicorn.access")
    if access.hasHandlers():
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        access.info('%s - "%s %s HTTP/%s" %d', where, scope["method"], scope["path"],
                    scope.get("http_version", "1.1"), CLIENT_CLOSED)


class AllowedHosts:
    """ASGI middleware: 403 unless the Host header names this server. On a loopback bind the
    names are 127.0.0.1, localhost, ::1 and --allow-host's: a web page that rebinds its own
    domain to 127.0.0.1 (DNS rebinding) then sends its own name, and is refused."""

    def __init__(self, app, hosts):
        self.app = app
        self.hosts = {h.strip("[]").rstrip(".").lower() for h in hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            raw = dict(scope["headers"]).get(b"host")
            name = _host_name(raw.decode("latin-1")) if raw is not None else None
            if name is not None and name not in self.hosts:
                e = api.APIError(f"the Host header {name!r} is not a name of this server "
                                 f"(allowed: {', '.join(sorted(self.hosts))}; add names with "
                                 f"--allow-host)", status=403, code="host_not_allowed")
                return await error_response(e)(scope, receive, send)
        return await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """'[::1]:8000' -> '::1', 'LocalHost.:80' -> 'localhost'."""
    host = host.strip()
    if host.startswith("["):
        name = host[1:].split("]", 1)[0]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".").lower()
