"""The HTTP layer: a Starlette app over the engines of the models it serves
(model_registry.py: one model, or several loaded on demand).

    GET  /                       the chat page (static/chat.html)
    GET  /favicon.ico            its icon (static/favicon.svg, an SVG whatever the name)
    GET  /health                 {"status": "ok", ...engine stats}
    GET  /metrics                Prometheus text format (metrics.py)
    GET  /v1/models[/{id}]       the models, each with its "status" (loaded, unloaded, ...)
    POST /v1/chat/completions    messages -> reply, the model's chat template
    POST /v1/completions         prompt -> continuation
    POST /v1/embeddings          input -> pooled hidden states (embeddings_api.py)
    POST /v1/responses           OpenAI's Responses API (responses_api.py); GET/DELETE by id
    POST /v1/messages            Anthropic's Messages API (messages_api.py); .../count_tokens

A request's model: `_for_model` is the one place where a request's `model` field becomes the
engine, tokenizer, n_ctx and model_id its handler uses (`s = await _for_model(request, s,
body)`); the model stays resident until the response has been sent (middleware.CountRequests
releases it). A model this server does not have is OpenAI's 404 model_not_found (a one-model server
takes any name, as it always has); 503 models_busy when it would have to be loaded and every
resident model has requests.

Requests are checked by openai_api.parse before anything is queued; the engine's stream is a
blocking iterator, so each request gets a thread that pumps it into an asyncio queue
(`_Generation`) and the event loop never blocks on the model. A client that hangs up is
noticed by a task that listens for http.disconnect, which cancels its sequence at once (the
engine frees the slot), streamed or not. Errors have OpenAI's shape: 400 with the field's name
in `param`, 401 without the API key, 403 for a Host header that is not this server's (DNS
rebinding), 408/413/415 for a body too slow, too large or not JSON, 429 when the engine's queue
is full, 500 for a request that failed alone while it was sampled, 503 while shutting down.
Connection-level guards (timeouts, the connection cap, TCP_NODELAY) are in transport.py, the
body's reading (its deadline, size and JSON limits) in intake.py.

The Responses and Messages APIs translate their bodies into chat completions' Request and
its engine output into their own shapes (`_serve_api`, one path for both; replies.py splits a
reply into reasoning, text and tool calls); their errors have their own API's shape.

Tenants: each API key (several may be configured; sent as `Authorization: Bearer KEY` or as
Anthropic's `x-api-key: KEY`) is a tenant, and a request's `cache_salt` (vLLM's field) divides
its tenant further; a request reuses cached prompt prefixes of its own partition only
(pyklei.runtime.engine: cache_partition), so neither the cached-token counts nor the time to
the first token tell one user anything of another's prompts. Without keys every
client is one tenant: clients that must not see each other send distinct cache_salts.

Nothing heavy runs on the event loop: parsing (tokenizing, templating, compiling a grammar
once per request), queueing and building a whole reply run in worker threads; a request is
parsed only once the queue has room for it. A streamed reply whose client stops reading is
cancelled after `write_timeout` seconds of waiting to write.
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..runtime.engine import EngineClosedError, QueueFullError, RequestFailedError
from . import embeddings_api, messages_api, openai_api as api, responses_api
from .intake import (ClientGone as _ClientGone, check_json_content_type as _check_json_content_type,
                     read_json as _read_json)
from .metrics import Metrics
from .middleware import CLIENT_CLOSED, LEASES, AllowedHosts, CountRequests, error_response
from .model_registry import (ModelLoadError, ModelRegistry, ModelsBusyError, ServedModel,
                             UnknownModelError)
from .replies import pieces as reply_pieces
from .sse import EventStream, WriteTimeout as _WriteTimeout, within as _within
from .whole_reply import WholeReply, generation_failed, submit as submit_reply

log = logging.getLogger("uvicorn.error")


class _Generation:
    """A request's engine streams (one per choice) seen from the event loop: a thread per
    stream iterates it and hands each GenerationResponse over as (choice index, response);
    `next()` awaits the next one, None once every choice has ended."""

    def __init__(self, streams, t_submit: float):
        self.streams = streams
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running = len(streams)
        self.finished = False
        self.client_gone = False
        self.t_submit = t_submit
        self.ttft = None          # submission -> first token, queue wait included (seconds)
        for i, stream in enumerate(streams):
            threading.Thread(target=self._pump, args=(i, stream), daemon=True,
                             name=f"pyklei-stream-{getattr(stream, 'id', '?')}").start()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:       # the loop is closed: the server is gone
            pass

    def _pump(self, index: int, stream) -> None:
        try:
            for r in stream:
                if self.ttft is None and r.generation_tokens:
                    self.ttft = time.perf_counter() - self.t_submit
                self._put((index, r))
            self._put((index, None))
        except BaseException as e:     # handed to the loop, raised there
            self._put((index, e))

    async def next(self):
        """(choice index, GenerationResponse) or None when all choices have ended; an error of
        any choice is raised (the others are cancelled by close())."""
        while self.running:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item is None:
                self.running -= 1
                continue
            return index, item
        self.finished = True
        return None

    async def watch_disconnect(self, receive) -> None:
        """Cancels the sequences when the client hangs up (run as a task beside the reply)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                for stream in self.streams:
                    stream.cancel()
                return

    def close(self) -> None:
        if not self.finished:
            for stream in self.streams:
                stream.cancel()


class _EventStream:
    """A streamed reply: OpenAI's chunks as Server-Sent Events, then `data: [DONE]`."""

    def __init__(self, state, req: api.Request, gen: _Generation):
        self.state, self.req, self.gen = state, req, gen

    async def __call__(self, scope, receive, send) -> None:
        s, req, gen = self.state, self.req, self.gen
        rid, created = api.new_id(req.kind), int(time.time())
        watcher = asyncio.ensure_future(gen.watch_disconnect(receive))
        shape = api.Logprobs(s.tokenizer)
        n = len(gen.streams)
        offsets = [len(req.prompt_text)] * n       # text_offset of completions' logprobs

        async def event(obj) -> None:
            data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            message = {"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                       "more_body": True}
            try:      # a client that does not read blocks the send (uvicorn's flow control)
                await _within(s.write_timeout, send(message))
            except asyncio.TimeoutError:
                raise _WriteTimeout() from None

        def piece(i: int, r, reasoning: str = "") -> dict:
            lps = None
            if r.logprobs is not None:
                lps = shape.chat(r.logprobs) if req.kind == "chat" else shape.text(
                    r.logprobs, offsets[i])
                if req.kind == "text":
                    offsets[i] = (lps["text_offset"][-1] + len(lps["tokens"][-1])
                                  if lps["tokens"] else offsets[i])
            return api.chunk(req.kind, rid, created, s.model_id, r.text, r.finish_reason,
                             index=i, logprobs=lps, reasoning=reasoning)

        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})     # nginx: pass each event on at once
            for i in range(n):
                if req.kind == "chat":
                    await event(api.chunk("chat", rid, created, s.model_id, first=True, index=i))
            lasts = [None] * n
            prompt_lps = None
            held = [None] * n     # with tools: text held while it may be a tool call
            held_lps = [None] * n
            # a thinking model: each choice's reasoning split from its content (which alone
            # goes on to the tool-call parser), pyklei.text.reasoning
            thinkers = [req.reasoning.parser() if req.reasoning else None for _ in range(n)]
            try:
                while (item := await gen.next()) is not None:
                    i, r = item
                    prompt_lps = prompt_lps or r.prompt_logprobs
                    if req.echo and lasts[i] is None:   # the prompt first, once it has run
                        echo = await run_in_threadpool(_echo_event, s, req, rid, created,
                                                       prompt_lps, shape, i)
                        await event(echo)
                    if req.calls and lasts[i] is None:
                        held[i], held_lps[i] = "", []
                    lasts[i] = r
                    thought = ""
                    if thinkers[i] is not None:
                        thought, content = thinkers[i].feed(r.text)
                        if r.finish_reason is not None:
                            more_t, more_c = thinkers[i].finish()
                            thought, content = thought + more_t, content + more_c
                        r = replace(r, text=content)
                        if thought and held[i] is not None:   # the call path may hold this piece
                            await event(api.chunk("chat", rid, created, s.model_id, index=i,
                                                  reasoning=thought))
                            thought = ""
                    if held[i] is not None:
                        held[i] += r.text
                        if r.logprobs is not None:
                            held_lps[i] += r.logprobs
                            r = replace(r, logprobs=held_lps[i])
                        if r.finish_reason is not None:
                            content, calls = req.calls.parse(held[i])
                            if calls:
                                await event(api.tool_call_chunk(rid, created, s.model_id, i,
                                                                content, calls,
                                                                req.legacy_functions))
                                continue
                            r = replace(r, text=held[i])
                            held[i] = None
                        else:     # content goes out as soon as it cannot become a call
                            text, held[i] = req.calls.split_stream(held[i])
                            if not text:
                                continue
                            r = replace(r, text=text)
                            held_lps[i] = []
                    if r.text or r.finish_reason or r.logprobs or thought:
                        await event(piece(i, r, thought))
            except Exception as e:         # this request failed (or the engine): say so in the stream
                if isinstance(e, RequestFailedError):
                    log.warning("%s", e)
                    message, code = str(e), "generation_failed"
                else:
                    message, code = f"{type(e).__name__}: {e}", None
                await event({"error": {"message": message, "type": "server_error",
                                       "param": None, "code": code}})
            else:
                if all(last is not None for last in lasts):
                    s.metrics.generation(lasts, gen.ttft)
                    if req.include_usage:
                        await event(api.chunk(req.kind, rid, created, s.model_id, lasts=lasts))
            await event(b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:                    # the client went away while we wrote
            pass
        except _WriteTimeout:              # the client stopped reading: its request ends
            log.warning("a streamed reply was not read for %g s: request cancelled",
                        s.write_timeout)
        finally:
            watcher.cancel()
            gen.close()


def _echo_event(s, req: api.Request, rid: str, created: int, prompt_lps, shape, i: int) -> bytes:
    """A completion's echoed prompt as one event's JSON (its logprobs can be megabytes: built
    in a worker thread)."""
    echo_lps = None if req.logprobs is None else shape.text(api.prompt_logprobs(req, prompt_lps), 0)
    return json.dumps(api.chunk("text", rid, created, s.model_id, req.prompt_text, index=i,
                                logprobs=echo_lps)).encode()


class _State:
    """The app's settings and its models. A request's handler works on a copy bound to its
    model (`_for_model`): engine, tokenizer, n_ctx and model_id exist only on that copy."""

    def __init__(self, models: ModelRegistry, api_keys, body_timeout, write_timeout,
                 special_in_content=False):
        self.models = models
        self.api_keys = [k.encode() for k in api_keys]   # empty: no key needed (one tenant)
        # a tenant's name in the prefix cache: its key's digest, not its index, so that the
        # blocks a restarted server finds on disk (--cache-dir) stay with the same key whatever
        # the order of the keys given
        self.cache_tenants = [hashlib.sha256(b"pyklei tenant\0" + k).hexdigest()
                              for k in self.api_keys]
        self.body_timeout, self.write_timeout = body_timeout, write_timeout
        self.special_in_content = special_in_content
        self.created = int(time.time())
        self.metrics = Metrics(models)
        self.responses = responses_api.ResponseStore()   # for previous_response_id

    def serving(self, served: ServedModel) -> "_State":
        bound = copy.copy(self)
        bound.engine, bound.tokenizer = served.engine, served.tokenizer
        bound.model_id, bound.n_ctx = served.model_id, served.n_ctx
        return bound


async def _for_model(request: HTTPRequest, s: _State, body) -> _State:
    """s bound to the model the body's `model` field names (none: the default model), loaded
    first if it is not resident (in a worker thread). It stays resident until the response
    has been sent: the lease is released by middleware.CountRequests."""
    name = body.get("model") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        raise api.APIError("'model' must be a string: a model's id (GET /v1/models)", "model")
    try:
        lease = await s.models.acquire(name)
    except UnknownModelError as e:
        raise api.APIError(str(e), "model", status=404, code="model_not_found") from None
    except ModelsBusyError as e:
        raise api.APIError(str(e), "model", status=503, type="server_error",
                           code="models_busy") from None
    except ModelLoadError as e:
        log.error("%s", e)
        raise api.APIError(str(e), "model", status=503, type="server_error",
                           code="model_load_failed") from None
    except EngineClosedError:
        raise _shutting_down() from None
    request.scope[LEASES].append(lease)
    return s.serving(lease.served)




def _check_key(s: _State, request: HTTPRequest) -> int | None:
    """The request's tenant: the index of its API key, None when the server has no keys; 401
    without a valid key. Every key is compared (in constant time), whichever matches."""
    if not s.api_keys:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if "x-api-key" in request.headers:           # Anthropic's clients send the key so
        scheme, token = "bearer", request.headers["x-api-key"]
    token = token.strip().encode()
    tenant = None
    for i, key in enumerate(s.api_keys):
        if hmac.compare_digest(token, key) and tenant is None:
            tenant = i
    if scheme.lower() != "bearer" or tenant is None:
        raise api.APIError("a valid API key is required: 'Authorization: Bearer KEY' or "
                           "'x-api-key: KEY'",
                           status=401, type="invalid_request_error", code="invalid_api_key")
    return tenant


def _submit(s: _State, req: api.Request, tenant: int | None):
    """Queues the request's choices (in a worker thread: each choice's grammar state and stop
    matcher are made here)."""
    try:
        return submit_reply(s.engine, req, s.tokenizer.eos_ids,
                            (None if tenant is None else s.cache_tenants[tenant], req.cache_salt))
    except QueueFullError:
        raise _queue_full() from None
    except EngineClosedError:
        raise _shutting_down() from None
    except (TypeError, ValueError) as e:
        raise api.APIError(str(e)) from None


def _shutting_down() -> api.APIError:
    return api.APIError("the server is shutting down", status=503, type="server_error",
                        code="shutting_down")


def _queue_full() -> api.APIError:
    return api.APIError("the server is busy (its queue is full); retry later", status=429,
                        type="rate_limit_error", code="queue_full")


async def _body(request: HTTPRequest):
    """(state, tenant, JSON body) of a POST, checked in this order; body None: the client left."""
    s: _State = request.app.state.pyklei
    tenant = _check_key(s, request)
    _check_json_content_type(request)
    try:
        body = await _read_json(request, s.body_timeout)
    except _ClientGone:
        return s, tenant, None
    return await _for_model(request, s, body), tenant, body


async def _start(s: _State, tenant, parse, *args):
    """(parse's result, _Generation of its request): `parse(*args)` (the Request first) in a
    worker thread, once the queue has room, then queued."""
    if not s.engine.has_room():      # before the costly part: parsing may compile a grammar
        raise _queue_full()
    # tokenizing and templating a long prompt, compiling a grammar: not on the event loop
    parsed = await run_in_threadpool(parse, *args)
    req = parsed[0] if isinstance(parsed, tuple) else parsed
    t_submit = time.perf_counter()
    return parsed, _Generation(await run_in_threadpool(_submit, s, req, tenant), t_submit)


async def _generate(request: HTTPRequest, kind: str) -> Response:
    s, tenant, body = await _body(request)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    req, gen = await _start(s, tenant, api.parse, kind, body, s.tokenizer, s.n_ctx,
                            s.special_in_content)
    if req.stream:
        return _EventStream(s, req, gen)
    watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
    reply = WholeReply(req)
    try:
        while (item := await gen.next()) is not None:
            reply.add(*item)
    except RequestFailedError as e:        # this request alone failed; say why, no traceback
        log.warning("%s", e)
        raise generation_failed(e) from None
    finally:
        watcher.cancel()
        gen.close()
    if gen.client_gone:
        return Response(status_code=CLIENT_CLOSED)
    s.metrics.generation(reply.lasts, gen.ttft)
    # a reply with logprobs can be megabytes of JSON: built in a worker thread
    return await run_in_threadpool(
        lambda: JSONResponse(reply.body(api.new_id(req.kind), s.model_id, s.tokenizer)))


async def _serve_api(request: HTTPRequest, front) -> Response:
    """A Responses or Messages API request (front: responses_api.Front or messages_api.Front)
    run as _generate runs a chat; its reply, events and errors in the front's shapes."""
    try:
        s, tenant, body = await _body(request)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        (req, turn), gen = await _start(s, tenant, front.parse, s, body, tenant)
    except api.APIError as e:
        return JSONResponse(front.error_body(e), e.status, _error_headers(e))

    async def counted():
        async for p in reply_pieces(req, gen):
            if p.kind == "end":
                s.metrics.generation([p.last], gen.ttft)
            yield p

    if req.stream:
        return EventStream(gen, front.stream(s, req, turn, counted()), s.write_timeout)
    watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
    try:
        out = await front.whole(s, req, turn, counted())
    except RequestFailedError as e:
        log.warning("%s", e)
        e = generation_failed(e)
        return JSONResponse(front.error_body(e), e.status)
    finally:
        watcher.cancel()
        gen.close()
    if gen.client_gone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(out)


async def responses(request):
    return await _serve_api(request, responses_api.Front)


async def messages(request):
    return await _serve_api(request, messages_api.Front)


async def count_tokens(request):
    try:
        s, _, body = await _body(request)
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(await run_in_threadpool(messages_api.count_tokens, body, s.tokenizer,
                                                    s.n_ctx, s.special_in_content))
    except api.APIError as e:
        return JSONResponse(messages_api.error_body(e), e.status, _error_headers(e))


async def stored_response(request):
    s = request.app.state.pyklei
    return JSONResponse(s.responses.answer(_check_key(s, request), request.path_params["rid"],
                                           delete=request.method == "DELETE"))


async def chat_completions(request):
    return await _generate(request, "chat")


async def completions(request):
    return await _generate(request, "text")


def _submit_embedding(s: _State, req):
    """Queues the inputs on the engine (in a worker thread: many inputs are a large copy)."""
    try:
        return s.engine.embed(req.ids, req.pooling)
    except QueueFullError:
        raise _queue_full() from None
    except EngineClosedError:
        raise api.APIError("the server is shutting down", status=503, type="server_error",
                           code="shutting_down") from None
    except ValueError as e:
        raise api.APIError(str(e), "input") from None


async def embeddings(request):
    """Queued on the engine (its embedding slots, between generation steps); a client that
    hangs up cancels what is left of its request."""
    s, _, body = await _body(request)
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    req = await run_in_threadpool(embeddings_api.parse, body, s.tokenizer, s.n_ctx, s.engine.model)
    fut = await run_in_threadpool(_submit_embedding, s, req)

    async def cancel_on_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        fut.cancel()

    watcher = asyncio.ensure_future(cancel_on_disconnect())
    try:
        pooled = await asyncio.wrap_future(fut)
    except asyncio.CancelledError:
        if not fut.cancelled():
            raise
        return Response(status_code=CLIENT_CLOSED)
    finally:
        watcher.cancel()
    # many vectors are megabytes of JSON: built in a worker thread
    return await run_in_threadpool(lambda: JSONResponse(embeddings_api.response(req, pooled, s.model_id)))


def _model(s: _State, model: dict) -> dict:
    """OpenAI's model object, and pyklei's "status" beside its fields (model_registry)."""
    return {"id": model["id"], "object": "model", "created": s.created, "owned_by": "pyklei",
            "status": model["status"]}


async def list_models(request):
    s = request.app.state.pyklei
    _check_key(s, request)
    return JSONResponse({"object": "list", "data": [_model(s, m) for m in s.models.models()]})


async def one_model(request):
    s = request.app.state.pyklei
    _check_key(s, request)
    name = request.path_params["model"]
    try:
        return JSONResponse(_model(s, {"id": name, "status": s.models.status(name)}))
    except UnknownModelError as e:
        raise api.APIError(str(e), "model", status=404, code="model_not_found") from None


async def health(request):
    """The engines' figures summed over the models (model_registry.stats), each model's
    status, and `model`: the default model's id."""
    s = request.app.state.pyklei
    return JSONResponse({"status": "ok", "model": s.models.default_id, **s.models.stats(),
                         "models": s.models.models()})


async def metrics(request):
    m = request.app.state.pyklei.metrics
    return Response(m.render(), media_type=m.content_type)


async def chat_page(request):
    return HTMLResponse(resources.files(__package__).joinpath("static/chat.html").read_text("utf-8"))


async def favicon(request):
    # browsers ask for /favicon.ico on any page of the server; an SVG under that name is shown
    # by Chrome and Firefox, which go by the media type
    icon = resources.files(__package__).joinpath("static/favicon.svg").read_bytes()
    return Response(icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})


def _error_headers(e: api.APIError):
    return {"Retry-After": "1"} if e.status == 429 or e.code == "models_busy" else (
        {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)


async def _api_error(request, e: api.APIError):
    return error_response(e, _error_headers(e))


async def _http_error(request, e: HTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(api.APIError(f"{request.method} {request.url.path}: {e.detail}",
                                       status=e.status_code, type=kind))


async def _server_error(request, e: Exception):
    return error_response(api.APIError(f"internal error: {type(e).__name__}: {e}", status=500,
                                       type="server_error"))


def create_app(engine=None, tokenizer=None, model_id: str | None = None,
               n_ctx: int | None = None, api_key=None,
               cors: list[str] | tuple = (), allowed_hosts: list[str] | None = None,
               body_timeout: float = 60.0, write_timeout: float = 30.0,
               on_shutdown=None, special_in_content: bool = False,
               models: ModelRegistry | None = None) -> Starlette:
    """The ASGI app of one model (engine: a pyklei.runtime.engine.Engine, its tokenizer,
    model_id, n_ctx: a sequence's context in tokens) or of `models` (model_registry.py);
    api_key: a key, or a list of keys (each a tenant; module doc), or None: no key needed;
    cors: allowed origins ("*" for any); allowed_hosts: the Host header names answered (None:
    any); body_timeout: seconds a request body may take to arrive; write_timeout: seconds a
    streamed reply may wait for its client to read before it is cancelled; on_shutdown:
    called when the server stops (after it drained its connections); special_in_content:
    parse special tokens written in chat messages (trusted clients only; serve
    --special-in-content)."""
    keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("API keys must be non-empty strings")
    if models is None:
        models = ModelRegistry.of_one(ServedModel(model_id, engine, tokenizer, n_ctx))
    state = _State(models, keys, body_timeout, write_timeout, special_in_content)
    middleware = [Middleware(CountRequests, metrics=state.metrics)]
    if allowed_hosts is not None:
        middleware.append(Middleware(AllowedHosts, hosts=allowed_hosts))
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors),
                                     allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type", "x-api-key",
                                                    "anthropic-version", "anthropic-beta"]))
    routes = [
        Route("/", chat_page),
        Route("/favicon.ico", favicon),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", one_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{rid}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
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
