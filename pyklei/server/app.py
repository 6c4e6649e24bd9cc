"""The HTTP layer: a Starlette app over one pyklei.engine.Engine.

    GET  /                       the chat page (static/chat.html)
    GET  /health                 {"status": "ok", ...engine stats}
    GET  /metrics                Prometheus text format (metrics.py)
    GET  /v1/models[/{id}]       the one model
    POST /v1/chat/completions    messages -> reply, the model's chat template
    POST /v1/completions         prompt -> continuation

Requests are checked by openai_api.parse before anything is queued; the engine's stream is a
blocking iterator, so each request gets a thread that pumps it into an asyncio queue
(`_Generation`) and the event loop never blocks on the model. A client that hangs up is
noticed by a task that listens for http.disconnect, which cancels its sequence at once (the
engine frees the slot), streamed or not. Errors have OpenAI's shape: 400 with the field's name
in `param`, 401 without the API key, 429 when the engine's queue is full, 503 while shutting
down.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..engine import EngineClosedError, QueueFullError
from . import openai_api as api
from .metrics import Metrics

MAX_BODY = 8 << 20
CLIENT_CLOSED = 499            # nginx's status for "the client closed the request"


def error_response(e: api.APIError, headers=None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _Generation:
    """One engine stream seen from the event loop: a thread iterates the blocking stream and
    hands each GenerationResponse over; `next()` awaits it (None at the end)."""

    def __init__(self, stream, t_submit: float):
        self.stream = stream
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.client_gone = False
        self.t_submit = t_submit
        self.ttft = None          # submission -> first token, queue wait included (seconds)
        threading.Thread(target=self._pump, daemon=True,
                         name=f"pyklei-stream-{getattr(stream, 'id', '?')}").start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:       # the loop is closed: the server is gone
            pass

    def _pump(self) -> None:
        try:
            for r in self.stream:
                if self.ttft is None and r.generation_tokens:
                    self.ttft = time.perf_counter() - self.t_submit
                self._put(r)
            self._put(None)
        except BaseException as e:     # handed to the loop, raised there
            self._put(e)

    async def next(self):
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is None:
            self.finished = True
        return item

    async def watch_disconnect(self, receive) -> None:
        """Cancels the sequence when the client hangs up (run as a task beside the reply)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                self.stream.cancel()
                return

    def close(self) -> None:
        if not self.finished:
            self.stream.cancel()


class _EventStream:
    """A streamed reply: OpenAI's chunks as Server-Sent Events, then `data: [DONE]`."""

    def __init__(self, state, req: api.Request, gen: _Generation):
        self.state, self.req, self.gen = state, req, gen

    async def __call__(self, scope, receive, send) -> None:
        s, req, gen = self.state, self.req, self.gen
        rid, created = api.new_id(req.kind), int(time.time())
        watcher = asyncio.ensure_future(gen.watch_disconnect(receive))

        async def event(obj) -> None:
            data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                        "more_body": True})

        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})     # nginx: pass each event on at once
            if req.kind == "chat":
                await event(api.chunk("chat", rid, created, s.model_id, first=True))
            last = None
            try:
                while (r := await gen.next()) is not None:
                    last = r
                    if r.text or r.finish_reason:
                        await event(api.chunk(req.kind, rid, created, s.model_id, r.text,
                                              r.finish_reason))
            except Exception as e:         # a bug in the engine: say so in the stream
                await event({"error": {"message": f"{type(e).__name__}: {e}",
                                       "type": "server_error", "param": None, "code": None}})
            else:
                if last is not None:
                    s.metrics.generation(last, gen.ttft)
                    if req.include_usage:
                        await event(api.chunk(req.kind, rid, created, s.model_id, last=last))
            await event(b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                    # the client went away while we wrote
            pass
        finally:
            watcher.cancel()
            gen.close()


class _State:
    def __init__(self, engine, tokenizer, model_id, n_ctx, eos_ids, api_key):
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.n_ctx, self.eos_ids, self.api_key = n_ctx, eos_ids, api_key
        self.created = int(time.time())
        self.metrics = Metrics(engine)


async def _read_json(request: HTTPRequest):
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise api.APIError(f"the body must be at most {MAX_BODY} bytes", status=413)
    chunks, n = [], 0
    async for c in request.stream():
        n += len(c)
        if n > MAX_BODY:
            raise api.APIError(f"the body must be at most {MAX_BODY} bytes", status=413)
        chunks.append(c)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise api.APIError(f"the body is not valid JSON: {e}") from None


def _check_key(s: _State, request: HTTPRequest) -> None:
    if s.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             s.api_key.encode()):
        raise api.APIError("a valid API key is required: 'Authorization: Bearer KEY'",
                           status=401, type="invalid_request_error", code="invalid_api_key")


def _submit(s: _State, req: api.Request):
    try:
        return s.engine.submit(req.ids, max_tokens=req.max_tokens, params=req.params,
                               stop=req.stop, eos_ids=s.eos_ids)
    except QueueFullError as e:
        raise api.APIError(f"the server is busy (its queue is full): {e}; retry later",
                           status=429, type="rate_limit_error", code="queue_full") from None
    except EngineClosedError:
        raise api.APIError("the server is shutting down", status=503, type="server_error",
                           code="shutting_down") from None
    except (TypeError, ValueError) as e:
        raise api.APIError(str(e)) from None


async def _generate(request: HTTPRequest, kind: str) -> Response:
    s: _State = request.app.state.pyklei
    _check_key(s, request)
    body = await _read_json(request)
    # tokenizing and templating a long prompt takes milliseconds: not on the event loop
    req = await run_in_threadpool(api.parse, kind, body, s.tokenizer, s.n_ctx)
    t_submit = time.perf_counter()
    gen = _Generation(_submit(s, req), t_submit)
    if req.stream:
        return _EventStream(s, req, gen)
    watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
    parts, last = [], None
    try:
        while (r := await gen.next()) is not None:
            parts.append(r.text)
            last = r
    finally:
        watcher.cancel()
        gen.close()
    if gen.client_gone:
        return Response(status_code=CLIENT_CLOSED)
    s.metrics.generation(last, gen.ttft)
    return JSONResponse(api.completion(kind, api.new_id(kind), s.model_id, "".join(parts), last))


async def chat_completions(request):
    return await _generate(request, "chat")


async def completions(request):
    return await _generate(request, "text")


def _model(s: _State) -> dict:
    return {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "pyklei"}


async def models(request):
    s = request.app.state.pyklei
    _check_key(s, request)
    return JSONResponse({"object": "list", "data": [_model(s)]})


async def one_model(request):
    s = request.app.state.pyklei
    _check_key(s, request)
    if request.path_params["model"] != s.model_id:
        raise api.APIError(f"no model {request.path_params['model']!r}; this server has "
                           f"{s.model_id!r}", "model", status=404, code="model_not_found")
    return JSONResponse(_model(s))


async def health(request):
    s = request.app.state.pyklei
    return JSONResponse({"status": "ok", "model": s.model_id, **s.engine.stats()})


async def metrics(request):
    m = request.app.state.pyklei.metrics
    return Response(m.render(), media_type=m.content_type)


async def chat_page(request):
    return HTMLResponse(resources.files(__package__).joinpath("static/chat.html").read_text("utf-8"))


async def _api_error(request, e: api.APIError):
    headers = {"Retry-After": "1"} if e.status == 429 else (
        {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
    return error_response(e, headers)


async def _http_error(request, e: HTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(api.APIError(f"{request.method} {request.url.path}: {e.detail}",
                                       status=e.status_code, type=kind))


async def _server_error(request, e: Exception):
    return error_response(api.APIError(f"internal error: {type(e).__name__}: {e}", status=500,
                                       type="server_error"))


class _CountRequests:
    """ASGI middleware: pyklei_requests_total by endpoint and the status actually sent."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [CLIENT_CLOSED]     # nothing sent: the client left first

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
            self.metrics.request(scope["path"], status[0])


def create_app(engine, tokenizer, model_id: str, n_ctx: int, eos_ids=None,
               api_key: str | None = None, cors: list[str] | tuple = (),
               on_shutdown=None) -> Starlette:
    """The ASGI app. engine: a pyklei.engine.Engine; n_ctx: a sequence's context in tokens;
    cors: allowed origins ("*" for any); on_shutdown: called when the server stops (after it
    drained its connections)."""
    state = _State(engine, tokenizer, model_id, n_ctx, eos_ids, api_key)
    middleware = [Middleware(_CountRequests, metrics=state.metrics)]
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    routes = [
        Route("/", chat_page),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", one_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={
        api.APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.pyklei = state
    return app
