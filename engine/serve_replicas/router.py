"""``SpecserveRouter``: Ray Serve's request router for the engine replicas, ranking by ``RoutingPolicy``.

It runs inside every handle to the replica deployment (here: the ingress). Serve calls ``choose_replicas`` for
each request and sends it to the first replica of the ranking that has a free slot (``max_ongoing_requests``).
The request's tokens go on the ledger of the replica ranked first when the ranking is made: Serve 2.60 reports
the replica it finally took only when it routes with rejection (``on_request_routed``), so a request that found
its first choice full is counted there until it finishes (``on_request_completed``), a bounded error that only
a full replica causes. A dead replica's entries are dropped (the ingress retries its requests, which are then
counted where they land). No FIFO mixin: the replica chosen for a request goes to that request.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.serve_replicas.routing import RouteRequest, RoutingConfig, RoutingPolicy
from engine.serve_replicas.wire import ReplicaRequest


def route_request(pending: PendingRequest | None) -> RouteRequest | None:
    """The routing view of a ``generate`` call; None for any other method (stats, pid)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaRequest):
        return None
    r: ReplicaRequest = pending.args[0]
    left = max(0, int(getattr(r.params, "max_tokens", 0) or 0) - len(r.output_token_ids))
    return RouteRequest(list(r.prompt_token_ids) + list(r.output_token_ids), left)


class SpecserveRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = RoutingPolicy(RoutingConfig(**kwargs))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = route_request(pending_request)
        ranked = self.policy.rank(list(by_id), req)
        if req is not None and ranked:  # a re-ranking of the same request (its first choice was full) moves it
            self.policy.ledger.start(ranked[0], pending_request.metadata.internal_request_id, req.cost)
        return [[by_id[i]] for i in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req = route_request(pending_request)  # only with strict max_ongoing_requests: the replica that took it
        if req is not None:
            self.policy.ledger.start(replica_id.unique_id, pending_request.metadata.internal_request_id, req.cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.ledger.finish(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.ledger.drop_replica(replica_id.unique_id)
