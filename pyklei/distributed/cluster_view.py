"""The whole deployment's `/metrics` and `/health` under `pyklei serve --ray`, from each
replica's own answer (no Ray here: unit-tested alone; the ingress, ray_serve_app.py, asks
every running replica and hands the answers to these functions).

    running_replicas(details, app, deployment)   the replicas Ray Serve's controller reports
                                                 RUNNING, each with its node (ReplicaPlace)
    merge_metrics(places, answers)               one Prometheus text exposition: every
                                                 replica's series labeled replica="<id>", one
                                                 HELP/TYPE per family, and pyklei_replica_up
    merge_health(places, answers)                (HTTP status, body): 200 "ok" only when every
                                                 replica answered ok, else 503 naming the others

An answer is the replica's reply body (bytes) when it answered 200, else a str saying why not
(an error, a timeout, another status). Why the replica label and not a sum: a router or an
autoscaler reads `waiting`, `running`, `kv_usage` and the prefix-cache counters per replica
(as vLLM's production-stack router reads each engine's), and Prometheus sums them itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"
UP_METRIC = "pyklei_replica_up"      # 1: the replica answered this scrape, 0: it did not


@dataclass(frozen=True)
class ReplicaPlace:
    """A running replica: its Serve id (what REPLICA_HEADER names) and its Ray node's id."""
    replica: str
    node: str


def running_replicas(details: dict, app: str, deployment: str) -> list[ReplicaPlace]:
    """The RUNNING replicas of `deployment` in `app`, from the controller's
    get_serve_instance_details() (the dict serve.status() is built from)."""
    dep = details.get("applications", {}).get(app, {}).get("deployments", {}).get(deployment, {})
    return sorted((ReplicaPlace(r["replica_id"], r.get("node_id") or "")
                   for r in dep.get("replicas", []) if str(_value(r.get("state"))) == "RUNNING"),
                  key=lambda p: p.replica)


def _value(state):
    return getattr(state, "value", state)     # a ReplicaState enum or its string


class _Families:
    """prometheus_client's collector interface over families built here."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(places: list[ReplicaPlace], answers: dict[str, bytes | str]) -> bytes:
    """One exposition of every replica's metrics, each sample labeled with its replica, in the
    order the families first appear; UP_METRIC{replica, node} for every replica in `places`."""
    families: dict[str, Metric] = {}
    for place in places:
        answer = answers.get(place.replica)
        if not isinstance(answer, bytes):
            continue
        for fam in text_string_to_metric_families(answer.decode("utf-8")):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
            for s in fam.samples:
                merged.samples.append(Sample(s.name, {REPLICA_LABEL: place.replica, **s.labels},
                                             s.value, s.timestamp, s.exemplar))
    up = Metric(UP_METRIC, "1 when the replica answered this scrape, else 0", "gauge")
    for place in places:
        up.samples.append(Sample(UP_METRIC, {REPLICA_LABEL: place.replica, "node": place.node},
                                 float(isinstance(answers.get(place.replica), bytes))))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), up]))
    return generate_latest(registry)


def merge_health(places: list[ReplicaPlace], answers: dict[str, bytes | str]) -> tuple[int, dict]:
    """(200, body) when every replica answered ok, else (503, body naming those that did not).
    body: status, the model, each replica's own /health (with its node), and the replicas'
    numeric figures summed (queued, running, ... as one `pyklei serve` reports them)."""
    replicas, failed, totals = [], {}, {}
    model = None
    for place in places:
        answer = answers.get(place.replica)
        own = _health_of(answer)
        if isinstance(own, str):
            failed[place.replica] = own
            replicas.append({"replica": place.replica, "node": place.node, "status": "unavailable",
                             "error": own})
            continue
        model = model or own.get("model")
        for key, value in own.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
        replicas.append({**own, "replica": place.replica, "node": place.node})
    body = {"status": "ok", "model": model, **totals, "replicas": replicas}
    if not places:
        return 503, {**body, "status": "unavailable", "message": "no replica is running"}
    if failed:
        named = ", ".join(f"{r} ({why})" for r, why in failed.items())
        return 503, {**body, "status": "unavailable", "unavailable": sorted(failed),
                     "message": f"{len(failed)} of {len(places)} replicas did not answer: {named}"}
    return 200, body


def _health_of(answer: bytes | str | None) -> dict | str:
    """A replica's /health body as a dict when it says ok, else why not (a str)."""
    if answer is None:
        return "not asked"
    if isinstance(answer, str):
        return answer
    try:
        own = json.loads(answer)
    except ValueError:
        return "its /health is not JSON"
    if not isinstance(own, dict) or own.get("status") != "ok":
        return f"its /health says {own.get('status') if isinstance(own, dict) else own!r}"
    return own
