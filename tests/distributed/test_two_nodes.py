"""pyklei on a Ray cluster of two nodes (ray.cluster_utils.Cluster: a head and a worker node
of one logical CPU each, both on this machine), joined with --ray-address as a user joins
theirs: `pyklei batch --ray` writes the local run's bytes with one engine on each node;
`pyklei serve --ray` puts one replica on each node, keeps a conversation on its replica, answers
/health and /metrics for both, and when the worker node goes mid-run only that node's requests
fail while the head's replica goes on answering.

The two nodes share this machine's address, so the worker node's Serve proxy gets a port of its
own (RAY_SERVE_WORKER_PROXY_HTTP_PORT); the tests talk to the head's proxy, on --port."""
import json
import os
import subprocess
import sys
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve", reason="needs the 'ray' extra (pip install -e '.[ray]')")
pytest.importorskip("ray.data", reason="needs the 'ray' extra (pip install -e '.[ray]')")

from live_server import LiveServer, free_port  # noqa: E402
from paths import ROOT, SEED  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from pyklei.distributed.ray_connect import SLOW_MACHINE_SERVE_TIMEOUTS  # noqa: E402
from pyklei.distributed.ray_serve_app import REPLICA_HEADER  # noqa: E402
from sse_lines import stream_lines  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    """(the Cluster, head node id, worker node): one CPU each. The cluster's processes take
    their environment from this one: this checkout's pyklei, the worker proxy's own port, the
    Serve timeouts a loaded 2-core machine needs (ray_connect.SLOW_MACHINE_SERVE_TIMEOUTS)."""
    from ray.cluster_utils import Cluster

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(free_port()), **SLOW_MACHINE_SERVE_TIMEOUTS}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                           "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster, cluster.head_node.node_id, worker
    finally:
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# greedy generations of each kind, an embedding and a bad line: enough lines for both engines
BATCH_LINES = [
    *(_line(f"chat-{i}", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"Say {word}."}], "max_tokens": 8,
             "temperature": 0}) for i, word in enumerate(("hello", "yes", "blue", "seven"))),
    *(_line(f"text-{i}", "/v1/completions", {"prompt": f"Once upon a {word}", "max_tokens": 8,
                                             "temperature": 0})
      for i, word in enumerate(("time", "hill", "river"))),
    _line("embed", "/v1/embeddings", {"input": ["a cat", "a dog"]}),
    "this is not json",
]


def _batch(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pyklei", "batch", str(SEED), *map(str, args),
                           "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, **kw)


def test_batch_on_two_nodes_writes_the_local_runs_bytes(two_nodes, tmp_path):
    cluster = two_nodes[0]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(BATCH_LINES) + "\n")
    r = _batch(inp, "-o", tmp_path / "local.jsonl", "--parallel", "2", "-t", "1")
    assert r.returncode == 0, r.stderr
    # two engines of one CPU each on two nodes of one CPU: one engine on each node
    r = _batch(inp, "-o", tmp_path / "ray.jsonl", "--parallel", "2", "--ray", "--ray-address",
               cluster.address, "--replicas", "2", "-t", "1")
    assert r.returncode == 0, r.stderr
    local = (tmp_path / "local.jsonl").read_bytes()
    assert local.count(b"\n") == len(BATCH_LINES)
    assert (tmp_path / "ray.jsonl").read_bytes() == local


SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}


def _chat(client, messages, **kw):
    r = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                  "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], r.json()


def _stream_lines(url, body, out: list, first: threading.Event):
    with httpx.Client(base_url=url, timeout=120) as client:     # one client per thread
        stream_lines(client, body, out, first, REPLICA_HEADER)


def _series(metrics_text: str, family: str) -> dict:
    """{replica: value} of a family's samples."""
    fams = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    return {s.labels["replica"]: s.value for s in fams[family].samples}


def test_serve_on_two_nodes_then_the_worker_node_goes(two_nodes, smollm2_q4):
    cluster, head_id, worker = two_nodes
    args = ["--ray", "--ray-address", cluster.address, "--replicas", "2", "--parallel", "2",
            "--model-id", "smollm2"]
    with LiveServer(smollm2_q4, *args, start_timeout=240) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as client:
        # where each replica runs, as /health reports it: one on each node
        health = client.get("/health")
        assert health.status_code == 200, health.text
        placed = {r["replica"]: r["node"] for r in health.json()["replicas"]}
        assert sorted(placed.values()) == sorted([head_id, worker.node_id]), (placed, head_id)
        on_worker = next(r for r, node in placed.items() if node == worker.node_id)

        # a second server joining the same cluster is refused in one line: it would redeploy
        # this one's application under it; this one goes on
        second = subprocess.run([sys.executable, "-m", "pyklei", "serve", str(smollm2_q4), *args,
                                 "--port", "0", "--quiet"], capture_output=True, text=True,
                                timeout=180, cwd=ROOT)
        assert second.returncode == 2, second.stderr[-2000:]
        assert "already serves an application named 'pyklei'" in second.stderr, second.stderr[-2000:]
        assert client.get("/health").status_code == 200

        # conversations spread over both nodes, and each turn follows its replica
        conversations = [[SYSTEM, {"role": "user", "content": f"Name a {thing}."}]
                         for thing in ("colour", "fruit")]
        where = [[], []]
        for n in range(2):
            for i, messages in enumerate(conversations):
                replica, reply = _chat(client, messages)
                where[i].append((replica, reply["usage"]))
                messages += [reply["choices"][0]["message"],
                             {"role": "user", "content": f"And another, number {n + 2}?"}]
        for turns in where:
            assert len({replica for replica, _ in turns}) == 1, where
            assert turns[1][1]["prompt_tokens_details"]["cached_tokens"] >= \
                turns[0][1]["prompt_tokens"], turns
        assert {turns[0][0] for turns in where} == set(placed)

        # /metrics: both replicas' series, one exposition
        text = client.get("/metrics").text
        assert set(_series(text, "pyklei_replica_up")) == set(placed)
        assert set(_series(text, "pyklei_num_requests_running")) == set(placed)

        # a long stream on each replica; then the worker node goes
        long = {"model": "smollm2", "max_tokens": 300, "temperature": 0,
                "messages": [{"role": "user", "content": "Count from one to two hundred in words."}]}
        a, b = [], []
        a_started, b_started = threading.Event(), threading.Event()
        ta = threading.Thread(target=_stream_lines, args=(srv.url, long, a, a_started))
        ta.start()
        assert a_started.wait(60)
        # another conversation: to the other replica, the one holding fewer
        other = {**long, "messages": [{"role": "user", "content": "List the months of the year, "
                                                                  "each with a sentence."}]}
        tb = threading.Thread(target=_stream_lines, args=(srv.url, other, b, b_started))
        tb.start()
        assert b_started.wait(60)
        assert {a[0], b[0]} == set(placed), (a[:2], b[:2])
        cluster.remove_node(worker, allow_graceful=False)     # as a machine that is lost
        ta.join(120)
        tb.join(120)
        assert not ta.is_alive() and not tb.is_alive()
        lost, kept = (a, b) if a[0] == on_worker else (b, a)
        # the worker's stream ends with an error event in OpenAI's shape, without [DONE]
        assert "data: [DONE]" not in lost
        error = json.loads(lost[-1][6:])["error"]
        assert error["code"] == "replica_unavailable" and "retry" in error["message"]
        # the head's went on to its end
        assert kept[-1] == "data: [DONE]", kept[-3:]
        # and the head's replica goes on answering: a retry, and the other conversation
        for messages in conversations:
            replica, reply = _chat(client, messages)
            assert placed[replica] == head_id and reply["choices"][0]["message"]["content"]
        # /health names the lost replica until Serve has let it go, then reports the head's
        health = client.get("/health")
        body = health.json()
        assert [r["replica"] for r in body["replicas"] if r["status"] == "ok"] == \
            [r for r, node in placed.items() if node == head_id], body
        if health.status_code == 503:
            assert body["unavailable"] == [on_worker] and on_worker in body["message"], body
        else:
            assert health.status_code == 200 and len(body["replicas"]) == 1, body

    # stopped, a server that joined a cluster takes its own application away, not Serve: other
    # users' applications and the controller stay (serve.delete, not serve.shutdown)
    import ray
    from ray import serve

    from pyklei.distributed.ray_serve_app import APP_NAME
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        assert APP_NAME not in serve.status().applications
        assert ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    finally:
        ray.shutdown()
