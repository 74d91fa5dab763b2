"""Per-replica metrics at the ingress: what each replica was sent and gave back, labeled ``replica``.

The ingress sees every request's stream, so it can count per replica without asking the replicas: requests
accepted, tokens generated, streams open now, and streams lost to a replica failure (then resumed elsewhere).
The aggregate figures (TTFT, ITL, e2e histograms, tokens) are the server's own ``ServerMetrics`` on the same
registry, observed at the ingress over all replicas.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.server.metrics import PREFIX


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
        self.retries = Counter(PREFIX + "replica_retries", "Requests sent again after a replica failed.",
                               ["model_name"], registry=registry)

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
