"""`pyklei serve` answered by the official `openai` client and by raw HTTP: chat and completion,
streamed and not, concurrent streams, a client hanging up (its sequence is cancelled), a full
queue (429), the API key (401), bad and unsupported requests (400 naming the field), CORS,
/metrics, and SIGTERM (drains, exits 0). Each server is a real subprocess on 127.0.0.1 over
the real engine and SmolLM2."""
import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

KEY = "sk-test-pyklei"
CHAT = [{"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_q4):
    with LiveServer(smollm2_q4, "--parallel", "4", "--max-queue", "8",
                    "--model-id", "smollm2") as srv:
        yield srv


@pytest.fixture(scope="module")
def tight(smollm2_q4):
    """One sequence, one queue place, an API key and CORS for one origin."""
    with LiveServer(smollm2_q4, "--parallel", "1", "--max-queue", "1", "--api-key", KEY,
                    "--cors", "http://example.test", "--model-id", "smollm2") as srv:
        yield srv


def client(srv, key="none", **kw):
    return srv.openai_client(key, **kw)


def post(srv, path, body=None, raw=None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(srv.url + path, content=data, headers=h, timeout=120)


# ---- the happy paths ------------------------------------------------------------------------

def test_models(server):
    assert [m.id for m in client(server).models.list()] == ["smollm2"]
    assert client(server).models.retrieve("smollm2").owned_by == "pyklei"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4")


def test_chat_plain_and_streamed_agree(server):
    c = client(server)
    plain = c.chat.completions.create(model="smollm2", messages=CHAT, temperature=0,
                                      max_tokens=24)
    text = plain.choices[0].message.content
    assert "Paris" in text and plain.choices[0].finish_reason in ("stop", "length")
    u = plain.usage
    assert u.prompt_tokens > 10 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(c.chat.completions.create(model="smollm2", messages=CHAT, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == u.completion_tokens
    finishes = [ch.choices[0].finish_reason for ch in body]
    assert finishes[-1] == plain.choices[0].finish_reason and not any(finishes[:-1])
    assert len(body) > 3                                  # streamed in pieces
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == text


def test_completions_plain_streamed_and_stop(server):
    c = client(server)
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6,
                             temperature=0)
    text = r.choices[0].text
    assert text.startswith(" Paris") and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    chunks = list(c.completions.create(model="smollm2", prompt="The capital of France is",
                                       max_tokens=6, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6,
                             temperature=0, stop=[","])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0


def test_concurrent_streams_each_match_their_solo_run(server):
    """Six streams at once (four decode together, two wait in the queue): each greedy reply is
    the one its prompt gets alone."""
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
               "The three primary colours are", "My favourite food is", "import numpy as np\n"]
    c = client(server)
    solo = [c.completions.create(model="m", prompt=p, max_tokens=12, temperature=0)
            .choices[0].text for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = "".join(ch.choices[0].text for ch in client(server).completions.create(
            model="m", prompt=prompts[i], max_tokens=12, temperature=0, stream=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert got == solo


def test_a_client_hanging_up_cancels_its_sequence(server):
    before = server.health()["cancelled"]
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 600, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: {" not in got:
        got += s.recv(4096)
    s.close()                              # hang up while tokens are still coming
    h = server.wait_health(lambda h: h["cancelled"] > before and h["running"] == 0)
    assert h["cancelled"] == before + 1
    # a plain (non-streamed) request whose client gives up is cancelled too
    before = h["cancelled"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time",
                   "max_tokens": 600, "temperature": 0}, timeout=1.0)
    server.wait_health(lambda h: h["cancelled"] > before and h["running"] == 0)


# ---- limits, keys and errors ----------------------------------------------------------------

def test_api_key(tight):
    with pytest.raises(openai.AuthenticationError) as e:
        client(tight).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(tight, key="wrong").chat.completions.create(model="m", messages=CHAT)
    assert [m.id for m in client(tight, key=KEY).models.list()] == ["smollm2"]
    r = httpx.get(tight.url + "/health")      # health, metrics and the page need no key
    assert r.status_code == 200 and httpx.get(tight.url + "/metrics").status_code == 200


def test_a_full_queue_gets_429(tight):
    """One sequence decoding, one waiting: the third request is turned away with 429."""
    def long_stream():
        return httpx.stream("POST", tight.url + "/v1/completions", timeout=120,
                            headers={"Authorization": f"Bearer {KEY}"},
                            json={"prompt": "Once upon a time", "max_tokens": 800,
                                  "temperature": 0, "stream": True})
    with long_stream() as a:
        assert a.status_code == 200
        lines = a.iter_lines()               # kept: a dropped iterator closes the response
        next(lines)                          # decoding
        with long_stream() as b:             # headers come at once; it waits for the slot
            assert b.status_code == 200
            tight.wait_health(lambda h: h["queued"] == 1 and h["running"] == 1)
            with pytest.raises(openai.RateLimitError) as e:
                client(tight, key=KEY).completions.create(model="m", prompt="hi", max_tokens=1)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    tight.wait_health(lambda h: h["queued"] == 0 and h["running"] == 0)
    r = client(tight, key=KEY).completions.create(model="m", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2   # served again once the queue emptied


def test_cors(tight):
    pre = httpx.options(tight.url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://example.test"
    other = httpx.options(tight.url + "/v1/chat/completions", headers={
        "Origin": "http://elsewhere.test", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", [1, 2], None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": "y"}},
     "stream_options"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "top_k": 2.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1}, "min_p"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_window": -1}, "repetition_window"),
    ("/v1/completions", {"prompt": "x", "seed": "1"}, "seed"),
    ("/v1/completions", {"prompt": "x " * 2000}, "prompt"),        # longer than the context
])
def test_bad_requests_get_400_naming_the_field(tight, path, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = post(tight, path, raw=raw, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_unsupported_fields_get_400_not_a_silent_200(tight, extra, param):
    kw = {"model": "m", "messages": CHAT, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client(tight, key=KEY).chat.completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert "not supported" in e.value.body["message"]


def test_prediction_gives_the_plain_reply_and_counts_its_drafts(server):
    """OpenAI's predicted outputs: the reply of a plain request as the prediction of the same
    request gives the same reply, mostly drafted; usage and timings count the drafts."""
    c = client(server)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "List the days of the week."}],
              temperature=0, max_tokens=40)
    plain = c.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None     # nothing drafted
    for pred in (text, [{"type": "text", "text": text}], text[:len(text) // 2] + " and so on"):
        r = c.chat.completions.create(**kw, prediction={"type": "content", "content": pred})
        assert r.choices[0].message.content == text
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0 and d.rejected_prediction_tokens >= 0
        t = r.model_extra["timings"]
        assert t["draft_n"] == d.accepted_prediction_tokens + d.rejected_prediction_tokens
        assert t["draft_n_accepted"] == d.accepted_prediction_tokens
        if pred is text:
            assert d.accepted_prediction_tokens >= r.usage.completion_tokens // 2


@pytest.mark.parametrize("prediction", [
    "text", {"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": 3},
    {"type": "content", "content": [{"type": "image_url"}]}, {"type": "content", "content": "x", "x": 1},
    {"type": "content", "content": "word " * 3000},            # longer than the context
])
def test_bad_predictions_get_400(server, prediction):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                              "prediction": prediction})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text


def test_no_op_values_of_unsupported_fields_are_accepted(tight):
    r = client(tight, key=KEY).chat.completions.create(
        model="m", messages=[{"role": "developer", "content": "Be terse."},
                             {"role": "user", "content": "Hi"}],
        max_tokens=2, n=1, logprobs=False, presence_penalty=0, tools=[],
        response_format={"type": "text"})
    assert r.usage.completion_tokens <= 2


def test_unknown_routes_and_methods(tight):
    r = httpx.post(tight.url + "/v1/audio/speech", json={"input": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(tight.url + "/v1/chat/completions").status_code == 405


def test_metrics(server):
    client(server).completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
    post(server, "/v1/completions", {"prompt": "x", "top_p": 0})
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['pyklei_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert samples['pyklei_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert samples["pyklei_generated_tokens_total"] >= 4
    assert samples["pyklei_prompt_tokens_total"] >= 1
    assert samples["pyklei_time_to_first_token_seconds_count"] >= 1
    assert samples["pyklei_decode_tokens_per_second_count"] >= 1
    assert samples["pyklei_queue_depth"] == 0 and samples["pyklei_running_sequences"] == 0
    assert samples["pyklei_parallel_slots"] == 4


def test_the_chat_page_is_served(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and 'id="cost"' in r.text


def test_sigterm_drains_in_flight_requests_and_exits_0(smollm2_q4):
    srv = LiveServer(smollm2_q4, "--parallel", "2", "--drain-timeout", "60").start()
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "max_tokens": 48,
                                "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: {")
            srv.proc.send_signal(15)                 # SIGTERM mid-reply
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                httpx.get(srv.url + "/health", timeout=5)
            events = [first] + [ln for ln in lines if ln]
        assert events[-1] == "data: [DONE]"          # the reply in flight was finished
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert len(text) > 40
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_sigterm_right_after_the_address_line_stops_the_server(tiny64):
    """A SIGTERM as soon as the address line is printed (before uvicorn has installed its own
    handlers) stops the server: it used to be swallowed, and the server ran on."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "pyklei", "serve", str(tiny64[1]), "--port",
                             "0", "-t", "1", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "http://127.0.0.1:" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_serve_command_line_mistakes_exit_2(tiny64, tmp_path):
    import socket
    import subprocess
    import sys

    def serve(*args):
        p = subprocess.run([sys.executable, "-m", "pyklei", "serve", *map(str, args)],
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stderr.strip()

    rc, err = serve(tmp_path / "missing.gguf")
    assert rc == 2 and err.startswith("pyklei serve: error:") and "missing.gguf" in err
    rc, err = serve(tiny64[1], "--port", "70000")
    assert rc == 2 and "port" in err and len(err.splitlines()) == 1
    rc, err = serve(tiny64[1], "--parallel", "0")
    assert rc == 2 and "parallel" in err
    with socket.socket() as busy:                 # a port already taken
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        rc, err = serve(tiny64[1], "--port", busy.getsockname()[1], "-c", "256")
    assert rc == 2 and "in use" in err and len(err.splitlines()) == 1, err
