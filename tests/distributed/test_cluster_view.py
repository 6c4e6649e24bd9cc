"""The cluster-wide /metrics and /health of `pyklei serve --ray` (pyklei.distributed.cluster_view),
without Ray: real `pyklei serve` metrics of two apps merged into one valid exposition, each
series labeled with its replica; /health ok only when every replica answered ok."""
import json

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pyklei.distributed.cluster_view import (ReplicaPlace, merge_health, merge_metrics,  # noqa: E402
                                             running_replicas)
from pyklei.server.metrics import Metrics  # noqa: E402


class _Engines:
    """What Metrics reads from a ModelRegistry: the engine figures of one replica."""

    def __init__(self, waiting: int, hits: int):
        self.waiting, self.hits = waiting, hits

    def stats(self):
        return {"queued": self.waiting, "running": 1, "n_parallel": 4, "kv_used_tokens": 10,
                "kv_capacity_tokens": 100, "prefix_cache_queries": 50,
                "prefix_cache_hits": self.hits, "cancelled": 0, "failed": 0,
                "drafted_tokens": 0, "accepted_tokens": 0}

    def models(self):
        return [{"id": "smollm2", "status": "loaded"}]


def _replica_metrics(waiting: int, hits: int, requests: int) -> bytes:
    m = Metrics(_Engines(waiting, hits))
    for _ in range(requests):
        m.request("/v1/chat/completions", 200)
    return m.render()


A, B, C = ReplicaPlace("aaaa1111", "node-head"), ReplicaPlace("bbbb2222", "node-w"), \
    ReplicaPlace("cccc3333", "node-w")


def test_metrics_of_every_replica_in_one_exposition_labeled_by_replica():
    text = merge_metrics([A, B, C], {A.replica: _replica_metrics(0, 40, 3),
                                     B.replica: _replica_metrics(2, 5, 1),
                                     C.replica: "no answer within 5 s"}).decode()
    # one HELP and one TYPE per family (what a Prometheus scraper requires)
    helps = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP")]
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")]
    assert len(helps) == len(set(helps)) and sorted(helps) == sorted(types)
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def per_replica(name, **labels):
        return {s.labels["replica"]: s.value for s in fams[name].samples
                if all(s.labels.get(k) == v for k, v in labels.items())
                and s.name in (name, name + "_total")}

    assert per_replica("pyklei_num_requests_waiting") == {A.replica: 0, B.replica: 2}
    assert per_replica("pyklei_prefix_cache_hits") == {A.replica: 40, B.replica: 5}
    assert per_replica("pyklei_kv_cache_usage_perc") == {A.replica: 0.1, B.replica: 0.1}
    assert per_replica("pyklei_requests", endpoint="/v1/chat/completions") == \
        {A.replica: 3, B.replica: 1}
    # a histogram keeps its buckets, per replica
    assert {s.labels["replica"] for s in fams["pyklei_time_to_first_token_seconds"].samples} == \
        {A.replica, B.replica}
    up = {s.labels["replica"]: (s.labels["node"], s.value) for s in fams["pyklei_replica_up"].samples}
    assert up == {A.replica: ("node-head", 1), B.replica: ("node-w", 1), C.replica: ("node-w", 0)}


def _health(**kw) -> bytes:
    return json.dumps({"status": "ok", "model": "smollm2", "queued": 1, "running": 2,
                       "models": [{"id": "smollm2", "status": "loaded"}], **kw}).encode()


def test_health_is_ok_only_when_every_replica_answers_ok():
    status, body = merge_health([A, B], {A.replica: _health(), B.replica: _health(running=3)})
    assert status == 200 and body["status"] == "ok" and body["model"] == "smollm2"
    assert (body["queued"], body["running"]) == (2, 5)          # the replicas' sum
    assert [(r["replica"], r["node"], r["running"]) for r in body["replicas"]] == \
        [(A.replica, "node-head", 2), (B.replica, "node-w", 3)]

    status, body = merge_health([A, B, C], {A.replica: _health(), B.replica: "ActorDiedError",
                                            C.replica: b'{"status": "draining"}'})
    assert status == 503 and body["status"] == "unavailable"
    assert body["unavailable"] == [B.replica, C.replica]
    assert "2 of 3 replicas" in body["message"] and "ActorDiedError" in body["message"]
    assert "draining" in body["message"]
    assert (body["queued"], body["running"]) == (1, 2)          # the live one's figures

    status, body = merge_health([], {})
    assert status == 503 and body["message"] == "no replica is running"


def test_running_replicas_from_the_controllers_details():
    details = {"applications": {"pyklei": {"deployments": {"PykleiReplica": {"replicas": [
        {"replica_id": "zz", "state": "RUNNING", "node_id": "n1"},
        {"replica_id": "aa", "state": "RUNNING", "node_id": "n2"},
        {"replica_id": "mm", "state": "STARTING", "node_id": "n2"}]}}}}}
    assert running_replicas(details, "pyklei", "PykleiReplica") == \
        [ReplicaPlace("aa", "n2"), ReplicaPlace("zz", "n1")]
    assert running_replicas(details, "other", "PykleiReplica") == []
