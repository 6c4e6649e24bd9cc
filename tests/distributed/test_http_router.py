"""`pyklei route` (pyklei.distributed.http_router): one endpoint over two `pyklei serve`
replicas on loopback, started as a user starts them. A conversation's turns stay on one
replica and reuse its prompt there, new conversations spread, replies (streamed too) come
through unchanged, a replica that stops loses no request that had not reached it, one that dies
mid-stream ends that stream with an error event, and nothing reachable is one 503."""
import json
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
from live_server import free_port, tiny_replicas  # noqa: E402
from paths import ROOT  # noqa: E402

from pyklei.distributed.replica_errors import REPLICA_HEADER  # noqa: E402


class Router:
    """`python -m pyklei route URL... --port 0` in a subprocess; .url once it answers."""

    def __init__(self, *urls, args=()):
        self.proc = subprocess.Popen([sys.executable, "-m", "pyklei", "route", *urls, "--port",
                                      "0", "--quiet", *args], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if "routing http://127.0.0.1:" not in line:
            self.proc.kill()
            raise RuntimeError(f"pyklei route did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.split("routing ", 1)[1].split("/v1", 1)[0]
        httpx.get(self.url + "/health", timeout=30)     # the app answers (200 or 503)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


@pytest.fixture
def replicas(tiny64):
    with tiny_replicas(tiny64[1]) as servers:
        yield servers


@pytest.fixture
def router(replicas):
    r = Router(*(s.url for s in replicas))
    try:
        yield r
    finally:
        assert r.stop() == 0


def complete(url, prompt, **kw):
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.headers.get(REPLICA_HEADER), r.json()


def test_conversations_stay_on_their_replica_and_reuse_it(replicas, router):
    urls = {s.url for s in replicas}
    talks = {c: f"conversation {c} begins with some words of its own" for c in range(4)}
    where = {c: [] for c in talks}
    for turn in range(3):
        for c in talks:
            replica, out = complete(router.url, talks[c])
            assert replica in urls
            where[c].append(replica)
            if turn:       # the replica still holds the conversation so far
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (c, turn)
            # the same reply as the replica gives directly (greedy)
            assert complete(replica, talks[c])[1]["choices"][0]["text"] == \
                out["choices"][0]["text"]
            talks[c] += out["choices"][0]["text"] + f" and then turn {turn}"
    assert all(len(set(w)) == 1 for w in where.values()), where
    firsts = [w[0] for w in where.values()]
    assert sorted(firsts.count(u) for u in urls) == [2, 2], where    # new ones spread

    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'pyklei_route_decisions_total{decision="prefix"} 8.0' in metrics
    health = httpx.get(router.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and all(r["up"] for r in health["replicas"])
    assert sum(r["requests"] for r in health["replicas"]) == 12


def test_stream_and_errors_pass_through(router):
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "prompt": "stream", "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA_HEADER]
        events = [ln for ln in r.iter_lines() if ln]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

    # a client that leaves mid-stream: the replica stops its sequence, the router its count
    for _ in range(2):
        with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
                "prompt": "leave", "max_tokens": 200, "stream": True}) as r:
            next(ln for ln in r.iter_lines() if ln.startswith("data:"))
    deadline = time.monotonic() + 10
    while any(x["in_flight"] for x in httpx.get(router.url + "/health").json()["replicas"]):
        assert time.monotonic() < deadline, "the router still counts requests whose client left"
        time.sleep(0.1)

    # the replica's own answers to bad requests, unchanged
    r = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(router.url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    # too large for any server: the router's 413, before any replica
    r = httpx.post(router.url + "/v1/completions", content=b"x" * (65 << 20), timeout=60)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]


def test_a_stopped_replica_loses_no_request(replicas, router):
    a, b = replicas
    replica, _ = complete(router.url, "the first conversation")
    owner = a if replica == a.url else b
    other = b if owner is a else a
    assert owner.terminate() == 0
    # its conversation's next turn cannot connect there: it goes to the other one, unharmed
    for i in range(3):
        replica, _ = complete(router.url, "the first conversation" + " goes on" * (i + 1))
        assert replica == other.url
    health = httpx.get(router.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert {r["url"]: r["up"] for r in health["replicas"]} == {owner.url: False, other.url: True}


def test_nothing_reachable_is_one_503():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = Router(*dead)
    try:
        r = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "replica_unavailable" and "no replica could be reached" in err["message"]
        r = httpx.post(router.url + "/v1/messages", timeout=30, json={"messages": []})
        assert r.status_code == 503 and r.json()["type"] == "error"      # Anthropic's shape
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        assert router.stop() == 0


def fake_replica(answer: bytes, requests: int = 8) -> str:
    """The URL of a replica that answers /health with 200 and any other request with the raw
    bytes `answer` (then closes the connection), for `requests` connections (a daemon thread)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(60)

    def serve():
        with srv:
            for _ in range(requests):
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
                                 if head.startswith(b"GET /health") else answer)
    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


def json_answer(status: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"connection: close\r\n\r\n").encode() + data


# an SSE reply whose replica is gone after one event (the connection closes mid-body)
DIES_MID_STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"transfer-encoding: chunked\r\n\r\n1c\r\ndata: {\"choices\": [\"one\"]}\n\n\r\n")


def test_a_request_a_replica_did_not_take_goes_to_the_next():
    full = fake_replica(json_answer("429 Too Many Requests", {"error": {"message": "busy"}}))
    ok = fake_replica(json_answer("200 OK", {"served": "by ok"}))
    router = Router(full, ok)
    try:
        for i in range(3):         # whichever it picks first, the answer is the one that took it
            r = httpx.post(router.url + "/v1/completions", json={"prompt": f"p{i}"}, timeout=30)
            assert r.status_code == 200 and r.json() == {"served": "by ok"}, r.text
            assert r.headers[REPLICA_HEADER] == ok
    finally:
        assert router.stop() == 0
    # when every replica refuses, the last refusal is the reply (a client retries it)
    a = fake_replica(json_answer("503 Service Unavailable", {"error": {"message": "stopping"}}))
    b = fake_replica(json_answer("503 Service Unavailable", {"error": {"message": "stopping"}}))
    router = Router(a, b)
    try:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "p"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "stopping"
    finally:
        assert router.stop() == 0


def test_a_replica_dying_mid_stream_ends_that_stream_with_an_error():
    url = fake_replica(DIES_MID_STREAM)
    router = Router(url)
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            assert r.status_code == 200
            events = [ln for ln in r.iter_lines() if ln]
        assert events[0] == 'data: {"choices": ["one"]}'
        err = json.loads(events[-1][6:])["error"]
        assert err["code"] == "replica_unavailable" and "retry it" in err["message"]
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert f'pyklei_route_replica_failures_total{{replica="{url}"}} 1.0' in metrics
    finally:
        assert router.stop() == 0


@pytest.mark.parametrize("args, message", [
    (["ftp://a:1"], "is not a replica's URL"),
    (["http://a:1", "http://a:1/v1/"], "is given twice"),
    (["http://a:1/x"], "has no path"),
    (["http://a:70000"], "the port is not a number"),
])
def test_bad_replica_urls_are_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "pyklei", "route", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_without_httpx_it_says_which_extra():
    code = ("import sys; sys.modules['httpx'] = None\n"
            "from pyklei.cli import main\n"
            "sys.exit(main(['route', 'http://127.0.0.1:1']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "pip install -e '.[serve]'" in r.stderr and "httpx" in r.stderr, \
        r.stderr
