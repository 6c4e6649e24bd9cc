"""examples/server.py, the OpenAI-compatible server, answered by a real HTTP client: streamed
replies parsed as Server-Sent Events, plain JSON replies, bad requests, one model shared by
concurrent clients, and a client that hangs up mid-stream."""
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(smollm2_q4):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "server.py"), str(smollm2_q4), "--port", "0",
         "-t", "1", "-c", "1024", "--quiet", "--model-id", "smollm2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        if "http://127.0.0.1:" not in line:
            proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()}")
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request(port, method, path, body=None, raw=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    return resp, conn


def post_json(port, path, body=None, raw=None):
    resp, conn = request(port, "POST", path, body, raw)
    try:
        return resp.status, resp.getheader("Content-Type"), json.loads(resp.read())
    finally:
        conn.close()


def sse_events(resp):
    """Parses a text/event-stream body: yields each event's data (a str)."""
    data = []
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line == "" and data:
            yield "\n".join(data)
            data = []
        elif line and not line.startswith(":"):
            raise AssertionError(f"not an SSE line: {line!r}")
    if data:
        yield "\n".join(data)


def stream(port, path, body):
    resp, conn = request(port, "POST", path, dict(body, stream=True))
    try:
        assert resp.status == 200
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        events = list(sse_events(resp))
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT = {"messages": [{"role": "system", "content": "Answer in one sentence."},
                     {"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 24}


def test_models(server):
    resp, conn = request(server, "GET", "/v1/models")
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["smollm2"]


def test_chat_completion(server):
    status, ctype, body = post_json(server, "/v1/chat/completions", CHAT)
    assert status == 200 and ctype == "application/json"
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] > 10 and u["completion_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_chat_completion_streamed(server):
    chunks = stream(server, "/v1/chat/completions",
                    dict(CHAT, stream_options={"include_usage": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
    finishes = [c["choices"][0]["finish_reason"] for c in body]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert len(body) > 3                  # streamed in pieces
    # the same greedy reply as the non-streamed request
    _, _, plain = post_json(server, "/v1/chat/completions", CHAT)
    assert text == plain["choices"][0]["message"]["content"]
    assert "Paris" in text


def test_completions_plain_and_streamed(server):
    req = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    status, _, body = post_json(server, "/v1/completions", req)
    assert status == 200 and body["object"] == "text_completion"
    text = body["choices"][0]["text"]
    assert text.startswith(" Paris") and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
    chunks = stream(server, "/v1/completions", req)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # stop strings are honoured and not returned
    status, _, body = post_json(server, "/v1/completions", dict(req, stop=[","]))
    assert body["choices"][0]["text"] == " Paris" and body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path, body, raw, param", [
    ("/v1/chat/completions", None, b"{not json", None),
    ("/v1/chat/completions", {"messages": []}, None, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, None, "messages"),
    ("/v1/chat/completions", dict(CHAT, temperature="hot"), None, "temperature"),
    ("/v1/chat/completions", dict(CHAT, top_p=0), None, "top_p"),
    ("/v1/chat/completions", dict(CHAT, max_tokens=10**6), None, "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, n=2), None, "n"),
    ("/v1/chat/completions", dict(CHAT, stream="yes"), None, "stream"),
    ("/v1/completions", {"prompt": ""}, None, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, None, "stop"),
    ("/v1/completions", [1, 2], None, None),
])
def test_bad_requests_get_400(server, path, body, raw, param):
    status, ctype, out = post_json(server, path, body, raw)
    assert status == 400 and ctype == "application/json"
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["message"]
    assert out["error"]["param"] == param



@pytest.mark.parametrize("field, value", [
    ("max_tokens", -2), ("max_completion_tokens", "many"), ("top_k", 2.5), ("min_p", 1),
    ("repetition_penalty", 0), ("repetition_window", -1), ("seed", "1"),
])
def test_request_fields_are_checked_by_the_schema(server, field, value):
    """Every sampling field and max_tokens is checked by pyklei's schema; the 400 names it."""
    status, _, out = post_json(server, "/v1/completions", {"prompt": "hi", field: value})
    assert status == 400 and out["error"]["param"] == field, out


def test_max_tokens_zero_runs_the_prompt_only(server):
    status, _, body = post_json(server, "/v1/completions",
                                {"prompt": "The capital of France is", "max_tokens": 0})
    assert status == 200 and body["choices"][0]["text"] == ""
    assert body["usage"]["completion_tokens"] == 0

def test_unknown_route_is_404(server):
    status, _, out = post_json(server, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "error" in out


def test_concurrent_requests_are_serialised(server):
    req = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    results = []

    def go():
        results.append(post_json(server, "/v1/completions", req))

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3
    texts = {r[2]["choices"][0]["text"] for r in results if r[0] == 200}
    assert len(texts) == 1 and texts.pop().startswith(" Paris")   # one model, no mixed contexts


def test_client_hanging_up_mid_stream_frees_the_model(server):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: {" not in got:
        got += s.recv(4096)
    s.close()                              # hang up while tokens are still coming
    t0 = time.monotonic()
    status, _, out = post_json(server, "/v1/completions",
                               {"prompt": "The capital of France is", "max_tokens": 4,
                                "temperature": 0})
    assert status == 200 and out["choices"][0]["text"].startswith(" Paris")
    assert time.monotonic() - t0 < 60
