"""Per-replica metrics at the ingress: what each replica was sent and gave back, labeled ``replica``.

The ingress sees every request's stream, so it can count per replica without asking the replicas: requests
accepted, tokens generated, streams open now, and streams lost to a replica failure (then resumed elsewhere).
The aggregate figures (TTFT, ITL, e2e histograms, tokens) are the server's own ``ServerMetrics`` on the same
registry, observed at the ingress over all replicas.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.server.metrics import PREFIX, EngineStats


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """One engine's view of several: counters and running/waiting summed, KV usage averaged. A replica that died
    keeps its last snapshot in the sum (its successor has a new id and counts from zero): the sums never fall."""
    if not snapshots:
        return EngineStats()
    depth = max(len(s.accepted_per_position) for s in snapshots)
    chosen: Tally[str] = Tally()
    for s in snapshots:
        chosen.update(dict(s.chosen_depths))
    return EngineStats(
        num_running=sum(s.num_running for s in snapshots), num_waiting=sum(s.num_waiting for s in snapshots),
        kv_cache_usage=sum(s.kv_cache_usage for s in snapshots) / len(snapshots),
        num_drafts=sum(s.num_drafts for s in snapshots), num_draft_tokens=sum(s.num_draft_tokens for s in snapshots),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in snapshots),
        accepted_per_position=tuple(sum(s.accepted_per_position[i] for s in snapshots
                                        if i < len(s.accepted_per_position)) for i in range(depth)),
        chosen_depths=tuple(sorted(chosen.items())),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in snapshots),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in snapshots))


class ReplicaMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        labels = ["model_name", "replica"]
        self.requests = Counter(PREFIX + "replica_requests", "Requests a replica accepted.", labels,
                                registry=registry)
        self.tokens = Counter(PREFIX + "replica_generation_tokens", "Tokens a replica generated.", labels,
                              registry=registry)
        self.open = Gauge(PREFIX + "replica_open_streams", "Streams open on a replica now.", labels,
                          registry=registry)
        self.lost = Counter(PREFIX + "replica_streams_lost", "Streams a replica failed mid-way (died, unreachable); "
                            "each is resumed on another replica from its tokens so far.", labels, registry=registry)
        self.accepted_tokens = Gauge(PREFIX + "replica_spec_decode_num_accepted_tokens", "Draft tokens a replica's "
                                     "engine accepted (cumulative, as of its last finished request).", labels,
                                     registry=registry)
        self.prefix_hits = Gauge(PREFIX + "replica_prefix_cache_hits", "Prompt tokens a replica found in its prefix "
                                 "cache (cumulative, as of its last finished request).", labels, registry=registry)
        self.retries = Counter(PREFIX + "replica_retries", "Requests sent again after a replica failed.",
                               ["model_name"], registry=registry)

    def engine_stats(self, replica: str, stats: EngineStats) -> None:
        self.accepted_tokens.labels(self.model_name, replica).set(stats.num_accepted_tokens)
        self.prefix_hits.labels(self.model_name, replica).set(stats.prefix_cache_hits)

    def accepted(self, replica: str) -> None:
        self.requests.labels(self.model_name, replica).inc()
        self.open.labels(self.model_name, replica).inc()

    def generated(self, replica: str, tokens: int) -> None:
        if tokens:
            self.tokens.labels(self.model_name, replica).inc(tokens)

    def closed(self, replica: str, lost: bool) -> None:
        self.open.labels(self.model_name, replica).dec()
        if lost:
            self.lost.labels(self.model_name, replica).inc()
            self.retries.labels(self.model_name).inc()
