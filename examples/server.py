"""A small OpenAI-compatible HTTP server for one pyklei model (standard library only).

    python examples/server.py smollm2.gguf --port 8000
    curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

Endpoints:
  GET  /v1/models             the one model
  POST /v1/chat/completions   messages -> reply (the model's chat template)
  POST /v1/completions        prompt -> continuation
With "stream": true the reply comes as Server-Sent Events, one `data: {...}` chunk per piece
of text in OpenAI's chunk shape, then `data: [DONE]`. Request fields used: max_tokens (or
max_completion_tokens), stop, stream, stream_options.include_usage, n (must be 1), and the
sampling options of pyklei's schema under their own names (pyklei.sampler.SAMPLING_OPTIONS:
temperature, top_p, seed, and the extensions top_k, min_p, repetition_penalty,
repetition_window), with its ranges and, when absent, its defaults. max_tokens follows
pyklei.generate.token_budget: -1 runs until the context is full, 0 the prompt only; when it is
absent, 512 for a chat and 16 for a completion (OpenAI's default), cut to the room the
context leaves. Unknown fields are ignored, as OpenAI-compatible servers commonly do; bad
values get a 400 JSON error that names the field.

The model is not thread-safe: requests are served one at a time (a lock), each on its own
thread. The KV cache keeps the previous request's tokens, so a chat that grows turn by turn
only runs its new tokens. It listens on 127.0.0.1 only; it has no authentication.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyklei
from pyklei.generate import token_budget
from pyklei.sampler import MAX_TOKENS, SAMPLING_OPTIONS

MAX_BODY = 8 << 20
DEFAULT_MAX_TOKENS = {"chat": 512, "text": 16}   # when a request gives none


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


def sampling_from(body) -> dict:
    """The sampling keywords of a request, each checked by pyklei's schema."""
    s = {}
    for o in SAMPLING_OPTIONS:
        v = body.get(o.name)
        if o is MAX_TOKENS or v is None:
            continue
        try:
            s[o.name] = o.check(v)
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e), o.name) from None
    return s


def stops_from(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop) and len(stop) <= 16:
        return stop
    raise BadRequest("'stop' must be a string or a list of up to 16 strings", "stop")


class Engine:
    """The model and a lock; turns a validated request into generation responses."""

    def __init__(self, path, model_id=None, **load_kw):
        self.llm = pyklei.load(path, **load_kw)
        self.model_id = model_id or Path(path).stem
        self.lock = threading.Lock()
        self.created = int(time.time())

    def prompt_ids(self, kind, body):
        tok = self.llm.tokenizer
        if kind == "chat":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            clean = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                    raise BadRequest(f"messages[{i}] needs a 'role' of system, user or assistant",
                                     "messages")
                content = m.get("content")
                if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                        raise BadRequest(f"messages[{i}]: only text content is supported", "messages")
                    content = "".join(str(p.get("text", "")) for p in content)
                if not isinstance(content, str):
                    raise BadRequest(f"messages[{i}].content must be a string", "messages")
                clean.append({"role": m["role"], "content": content})
            try:
                return tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
            except ValueError as e:
                raise BadRequest(f"cannot render the chat template: {e}", "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string", "prompt")
        return tok.encode(prompt, parse_special=True)

    def prepare(self, kind, body):
        """Validates the request. -> (prompt ids, max_tokens, stops, sampling)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise BadRequest("only n=1 is supported", "n")
        # "model" is not checked: the one model serves any name, as single-model servers do
        ids = self.prompt_ids(kind, body)
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        asked = body.get(key)
        try:   # a default is cut to the room left; a count asked for must fit
            max_tokens = token_budget(self.llm.n_ctx, len(ids),
                                      DEFAULT_MAX_TOKENS[kind] if asked is None else asked,
                                      trim=asked is None)
        except (TypeError, ValueError) as e:
            prompt_fits = isinstance(e, TypeError) or len(ids) < self.llm.n_ctx
            raise BadRequest(str(e), key if prompt_fits else
                             "messages" if kind == "chat" else "prompt") from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", "stream")
        return ids, max_tokens, stops_from(body), sampling_from(body)

    def generate(self, ids, max_tokens, stops, sampling):
        return self.llm.generate(ids, max_tokens=max_tokens, stream=True, stop=stops, **sampling)


def usage(r):
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.generation_tokens,
            "total_tokens": r.prompt_tokens + r.generation_tokens}


class Handler(BaseHTTPRequestHandler):
    server_version = "pyklei-server/" + pyklei.__version__
    engine: Engine = None          # set by serve()
    quiet = False

    def log_message(self, fmt, *args):
        if not self.quiet:
            sys.stderr.write(f"{self.address_string()} - {fmt % args}\n")

    # ---- helpers ---------------------------------------------------------------------------
    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status, message, param=None, etype="invalid_request_error"):
        self.send_json(status, {"error": {"message": message, "type": etype, "param": param,
                                          "code": None}})

    def read_body(self):
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a Content-Length header is required", status=411) from None
        if n < 0 or n > MAX_BODY:
            raise BadRequest(f"the body must be at most {MAX_BODY} bytes", status=413)
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}") from None

    # ---- routes ----------------------------------------------------------------------------
    def do_GET(self):
        e = self.engine
        if self.path.rstrip("/") == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": e.model_id, "object": "model", "created": e.created, "owned_by": "pyklei"}]})
        elif self.path.rstrip("/") == f"/v1/models/{e.model_id}":
            self.send_json(200, {"id": e.model_id, "object": "model", "created": e.created,
                                 "owned_by": "pyklei"})
        elif self.path in ("/", "/health"):
            self.send_json(200, {"status": "ok", "model": e.model_id})
        else:
            self.send_error_json(404, f"no route GET {self.path}", etype="not_found_error")

    def do_POST(self):
        route = self.path.rstrip("/")
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "text"}.get(route)
        if kind is None:
            self.send_error_json(404, f"no route POST {self.path}", etype="not_found_error")
            return
        try:
            body = self.read_body()
            req = self.engine.prepare(kind, body)
        except BadRequest as e:
            self.send_error_json(e.status, str(e), e.param)
            return
        with self.engine.lock:              # one generation at a time: the model is not thread-safe
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self.stream(kind, req, include_usage)
            else:
                try:
                    self.complete(kind, req)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                except Exception as e:  # a bug: say so in JSON rather than drop the connection
                    self.send_error_json(500, f"{type(e).__name__}: {e}", etype="server_error")

    def complete(self, kind, req):
        e = self.engine
        parts, last = [], None
        for r in e.generate(*req):
            parts.append(r.text)
            last = r
        text = "".join(parts)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
            obj = "text_completion"
        self.send_json(200, {"id": rid, "object": obj, "created": int(time.time()),
                             "model": e.model_id, "choices": [choice], "usage": usage(last),
                             "timings": {"time_to_first_token_s": last.time_to_first_token,
                                         "prompt_tok_s": last.prompt_tps,
                                         "generation_tok_s": last.generation_tps}})

    def stream(self, kind, req, include_usage):
        e = self.engine
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(choice, extra=None):
            chunk = {"id": rid, "object": obj, "created": created, "model": e.model_id,
                     "choices": [choice] if choice is not None else []}
            if extra:
                chunk.update(extra)
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()

        def piece(text, finish=None, first=False):
            if kind == "chat":
                delta = {"role": "assistant", "content": text} if first else (
                    {"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        it = e.generate(*req)
        try:
            if kind == "chat":
                event(piece("", first=True))
            last = None
            for r in it:
                last = r
                if r.text:
                    event(piece(r.text))
                if r.finish_reason:
                    event(piece("", finish=r.finish_reason))
            if include_usage and last is not None:
                event(None, {"usage": usage(last)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            it.close()   # the client went away: stop generating, free the lock


def make_server(model_path, host="127.0.0.1", port=8000, model_id=None, quiet=False, **load_kw):
    engine = Engine(model_path, model_id=model_id, **load_kw)
    handler = type("BoundHandler", (Handler,), {"engine": engine, "quiet": quiet})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def main(argv=None):
    ap = argparse.ArgumentParser(description="OpenAI-compatible HTTP server for one pyklei model.")
    ap.add_argument("model", help="pyklei .gguf file")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default %(default)s)")
    ap.add_argument("--model-id", help="the model's name in the API (default: the file name)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-c", "--ctx-size", type=int, default=None)
    ap.add_argument("--quiet", action="store_true", help="no request log")
    args = ap.parse_args(argv)
    if not Path(args.model).is_file():
        ap.exit(2, f"server.py: error: no such model file: {args.model}\n")
    try:
        httpd = make_server(args.model, args.host, args.port, args.model_id, args.quiet,
                            n_threads=args.threads, n_ctx=args.ctx_size)
    except ValueError as e:
        ap.exit(2, f"server.py: error: {e}\n")
    host, port = httpd.server_address[:2]
    print(f"serving {httpd.RequestHandlerClass.engine.model_id} on http://{host}:{port}/v1",
          flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    main()
