"""`pyklei serve --ray` live, on a local Ray cluster of 2 CPUs (one for this module): two
SmolLM2 replicas of one thread behind the prefix-aware router. A conversation's turns stay on
the replica that served its previous turn, which reuses that prompt (cached_tokens); new
conversations spread over both; streaming passes through; errors keep their API's shape; a
replica killed mid-stream fails only its own request, which a retry completes elsewhere;
/metrics and /health answer for both replicas.
(The cluster: tests/distributed/conftest.py; autoscaling: test_serve_ray_autoscale.py.)"""
import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve", reason="needs the 'ray' extra (pip install -e '.[ray]')")

from pyklei.distributed.ray_serve_app import APP_NAME, REPLICA_HEADER  # noqa: E402
from ray_serve_apps import smollm2_application  # noqa: E402
from sse_lines import stream_lines  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}


@pytest.fixture(scope="module")
def served(ray_cluster, smollm2_q4):
    from ray import serve

    serve.run(smollm2_application(smollm2_q4), name=APP_NAME, route_prefix="/")
    with httpx.Client(base_url=ray_cluster[1], timeout=120) as client:
        yield client
    serve.delete(APP_NAME)


def _chat(client, messages, **kw):
    r = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                  "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], r.json()


def test_turns_follow_their_conversation_and_new_ones_spread(served):
    conversations = [[SYSTEM, {"role": "user", "content": f"Name a {thing}."}]
                     for thing in ("colour", "fruit", "river")]
    where = {i: [] for i in range(len(conversations))}

    def turn(i, n):
        replica, reply = _chat(served, conversations[i])
        where[i].append((replica, reply["usage"]))
        conversations[i] += [reply["choices"][0]["message"],
                             {"role": "user", "content": f"And another, number {n + 2}?"}]

    # the first turns at once, as users arrive: each takes its own slot of its replica (one
    # after the other, a new conversation would take the idle slot of another that shares the
    # model's default system prompt: the engine's slot-level reuse, pyklei.runtime.engine)
    first = [threading.Thread(target=turn, args=(i, 0)) for i in range(len(conversations))]
    for t in first:
        t.start()
    for t in first:
        t.join()
    for n in (1, 2):
        for i in range(len(conversations)):
            turn(i, n)
    for i, turns in where.items():
        assert len({replica for replica, _ in turns}) == 1, (i, turns)
        for (_, before), (_, now) in zip(turns, turns[1:]):
            # the replica still holds the previous turn: it prefills about the new part only
            assert now["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"], turns
    assert len({turns[0][0] for turns in where.values()}) == 2      # both replicas serve


def test_stream_passes_through_and_errors_keep_their_shape(served):
    with served.stream("POST", "/v1/chat/completions", json={
            "model": "smollm2", "messages": [SYSTEM, {"role": "user", "content": "Hi"}],
            "max_tokens": 5, "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA_HEADER]
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"

    r = served.post("/v1/chat/completions", json={"model": "smollm2", "messages": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = served.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the ingress holds no more of a body than a replica would take
    r = served.post("/v1/completions", content=b" " * ((8 << 20) + 1),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]
    assert served.get("/v1/models").json()["data"][0]["id"] == "smollm2"
    assert served.get("/health").json()["status"] == "ok"


def _generated_tokens(client) -> dict:
    """{replica: its pyklei_generated_tokens_total}, from the ingress's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    return {s.labels["replica"]: s.value for s in fams["pyklei_generated_tokens"].samples
            if s.name == "pyklei_generated_tokens_total"}


def test_metrics_and_health_answer_for_every_replica(served):
    before = _generated_tokens(served)
    assert len(before) == 2
    replica, reply = _chat(served, [{"role": "user", "content": "Say yes."}])
    after = _generated_tokens(served)
    # the replica that answered counted its tokens; the other one's series did not move
    assert after[replica] - before[replica] == reply["usage"]["completion_tokens"] > 0
    (other,) = set(after) - {replica}
    assert after[other] == before[other]
    health = served.get("/health")
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ok" and {r["replica"] for r in body["replicas"]} == set(after)
    assert body["n_parallel"] == sum(r["n_parallel"] for r in body["replicas"])


def _stream_lines(client, body, out: list, first: threading.Event):
    stream_lines(client, body, out, first, REPLICA_HEADER)


def test_a_killed_replica_fails_only_its_own_request(served, ray_cluster):
    ray = ray_cluster[0]
    long = {"model": "smollm2", "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to two hundred in words."}]}
    short = {"model": "smollm2", "max_tokens": 24, "temperature": 0,
             "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}
    a, b = [], []
    a_started, b_started = threading.Event(), threading.Event()
    ta = threading.Thread(target=_stream_lines, args=(served, long, a, a_started))
    ta.start()
    assert a_started.wait(60)
    # the other request goes to the other, idle replica
    tb = threading.Thread(target=_stream_lines, args=(served, short, b, b_started))
    tb.start()
    assert b_started.wait(60)
    assert a[0] != b[0], (a[:2], b[:2])
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#PykleiReplica#{a[0]}", namespace="serve"))
    ta.join(60)
    tb.join(60)
    assert not ta.is_alive() and not tb.is_alive()
    # the killed replica's stream ends with an error event in OpenAI's shape, without [DONE]
    assert "data: [DONE]" not in a
    error = json.loads(a[-1][6:])["error"]
    assert error["code"] == "replica_unavailable" and "retry" in error["message"]
    # the other one finished normally
    assert b[-1] == "data: [DONE]"
    assert json.loads(b[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    # the client retries and a live replica answers
    replica, reply = _chat(served, long["messages"], max_tokens=4)
    assert replica != a[0] and reply["choices"][0]["message"]["content"]
