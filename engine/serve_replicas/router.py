"""``SpecserveRouter``: Ray Serve's request router for the engine replicas, ranking by ``RoutingPolicy``.

It runs inside every handle to the replica deployment (here: the ingress). Serve calls ``choose_replicas`` for
each request and sends it to the first replica of the ranking that has a free slot (``max_ongoing_requests``);
``on_request_routed`` / ``on_request_completed`` keep the token ledger; a dead replica's entries are dropped (the
ingress retries its requests, which are then counted where they land).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.serve_replicas.routing import RouteRequest, RoutingConfig, RoutingPolicy
from engine.serve_replicas.wire import ReplicaRequest


def route_request(pending: PendingRequest | None) -> RouteRequest | None:
    """The routing view of a ``generate`` call; None for any other method (stats, pid)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaRequest):
        return None
    r: ReplicaRequest = pending.args[0]
    left = max(0, int(getattr(r.params, "max_tokens", 0) or 0) - len(r.output_token_ids))
    return RouteRequest(list(r.prompt_token_ids) + list(r.output_token_ids), left)


class SpecserveRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = RoutingPolicy(RoutingConfig(**kwargs))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in self.policy.rank(list(by_id), route_request(pending_request))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = route_request(pending_request)
        if req is not None:
            self.policy.ledger.start(replica_id.unique_id, pending_request.metadata.internal_request_id, req.cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.ledger.finish(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.ledger.drop_replica(replica_id.unique_id)
