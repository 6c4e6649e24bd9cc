"""The replicas' request router on Ray Serve's request-router API (ray.serve.request_router;
the same API as ray.llm's PrefixCacheAffinityRouter): prefix_routing.choose_replicas over the
queue lengths Ray keeps for each replica.

Ray calls choose_replicas for each request a DeploymentHandle sends to the replicas (here: the
ingress, ray_serve_app.py) with the request's arguments; the first argument is a
ForwardedRequest whose routing_key the ingress computed. It then sends the request to a replica
of the first rank that has room, trying the next rank when none has (`max_ongoing_requests`).
The first rank is one replica, and its key is recorded for it there and then: Ray calls
on_request_routed only when it runs with strict max_ongoing_requests, so that hook cannot be
what the tree learns from. (When that one replica is full the request goes to another one
while the tree says the first: the next turn then prefills once more, and is recorded right.)

The tree lives in the router, that is in each process that holds a handle to the replicas:
the one ingress replica by default. With several ingress replicas each learns from its own
share of the traffic (ray.llm keeps one tree in a detached actor instead, at the price of an
actor call per request).
"""
from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .prefix_routing import DEFAULT_CHARS_PER_REPLICA, MIN_MATCH_FRACTION, PrefixTree, choose_replicas


def _key_of(pending_request: PendingRequest | None) -> str:
    args = pending_request.args if pending_request is not None else ()
    return getattr(args[0], "routing_key", "") if args else ""


class PrefixAwareRequestRouter(RequestRouter):
    """Sends a request to the replica that was sent the earlier request it continues (the
    longest such), unless that replica's queue is `imbalance` requests longer than the
    shortest one; else to the least-loaded replica holding least (prefix_routing.py). Counts
    its decisions in `decisions` (prefix / least_loaded)."""

    def initialize_state(self, imbalance: int = 4, min_match_fraction: float = MIN_MATCH_FRACTION,
                         chars_per_replica: int = DEFAULT_CHARS_PER_REPLICA, **kwargs):
        self.tree = PrefixTree(chars_per_replica)
        self.imbalance = imbalance
        self.min_match_fraction = min_match_fraction
        self.decisions = {"prefix": 0, "least_loaded": 0}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        queues = {}
        unknown = []
        for r in candidate_replicas:
            q = self.replica_queue_len_cache.get(r.replica_id)
            if q is None:
                unknown.append(r)
            else:
                queues[r.replica_id] = q
        if unknown:       # ask the replicas themselves, as Ray's own routers do
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None:
                    queues[r.replica_id] = q
        if not queues:    # no replica answered: any of them, Ray retries with backoff
            return [candidate_replicas]
        key = _key_of(pending_request)
        chosen, why = choose_replicas(self.tree, key, queues, self.imbalance,
                                      self.min_match_fraction)
        self.decisions[why] += 1
        pick = random.choice(chosen)
        if key:
            self.tree.insert(key, pick)
        rest = sorted((r for r in candidate_replicas if r.replica_id != pick),
                      key=lambda r: queues.get(r.replica_id, 1 << 30))
        return [[by_id[pick]], rest] if rest else [[by_id[pick]]]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.tree.remove(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:        # scaled down, or replaced after a failed health check
            self.tree.remove(replica_id)
