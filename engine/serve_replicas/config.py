"""``ReplicaAppConfig``: everything the replicated app needs, from the CLI or from a Serve config file's ``args``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.core.args import EngineArgs
from engine.serve_replicas.routing import RoutingConfig
from engine.server.limits import ServerLimits


@dataclass(frozen=True)
class AutoscalingConfig:
    """Ray Serve's autoscaling on queue depth (ongoing requests per replica)."""

    min_replicas: int = 1
    max_replicas: int = 2
    # Ongoing requests per replica Serve aims at: lower scales up sooner (more engines, each less batched),
    # higher keeps fewer engines busier (better batching, longer queues).
    target_ongoing_requests: float = 4.0
    # How long the load must stay above / below target before a replica is added / removed: short reacts
    # fast, long avoids starting an engine (seconds of loading) for a burst.
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"autoscaling: need 0 <= min_replicas <= max_replicas and max_replicas >= 1; got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"autoscaling: target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")

    def to_serve(self, initial: int) -> dict[str, Any]:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": min(max(initial, self.min_replicas), self.max_replicas),
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": 1.0, "look_back_period_s": 2.0}


@dataclass(frozen=True)
class ReplicaAppConfig:
    engine: EngineArgs = field(default_factory=EngineArgs)
    served_model_name: str = "specserve-default"
    replicas: int = 1  # fixed count; with ``autoscaling`` the initial count
    autoscaling: AutoscalingConfig | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Ray resources of each replica's own process (its engine loop; the engine places TP workers itself): one
    # CPU on a CPU engine, so N replicas need N cores; on GPUs its workers hold the GPUs.
    replica_num_cpus: float = 1.0
    cores: tuple[int, ...] | None = None  # pin replica i of a node to cores[i % len]; None: no pinning
    host: str = "127.0.0.1"  # where Serve's HTTP proxy listens: anything but loopback needs api_key
    port: int = 8000
    api_key: str | None = None  # default: $SPECSERVE_API_KEY
    max_queue: int = 256  # per replica, as the one-engine server's --max-queue
    data_dir: str | None = None  # the Batch API's store, held by the ingress alone
    # Ray custom resources the ingress asks for: on Kubernetes, one the node with the job store's volume offers
    # (the head), so the ingress and its store land together.
    ingress_resources: dict[str, float] = field(default_factory=dict)
    batch_max_in_flight: int | None = None
    # Seconds a replica being removed (scale-down, redeploy) keeps serving its open streams: longer than the
    # longest request, or those streams are cut (and resumed elsewhere by the ingress).
    graceful_shutdown_timeout_s: float = 120.0
    max_retries: int = 3  # replica failures one request survives (each resumes from its tokens so far)
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_queue < 0 or self.max_retries < 0:
            raise ValueError("max_queue and max_retries must be >= 0")

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ReplicaAppConfig:
        """From a Serve config file's ``args``: ``engine`` holds ``specserve generate``'s flags as fields
        (``target``, ``speculative_config``, ``tensor_parallel_size``...); ``routing`` / ``autoscaling`` /
        ``limits`` their own dataclasses' fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"unknown specserve app args: {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(sorted(known))})")
        kw = dict(args)
        kw["engine"] = EngineArgs(**kw.get("engine", {}))
        kw["routing"] = RoutingConfig(**kw.get("routing", {}))
        kw["limits"] = ServerLimits(**kw.get("limits", {}))
        if kw.get("autoscaling") is not None:
            kw["autoscaling"] = AutoscalingConfig(**kw["autoscaling"])
        if kw.get("cores") is not None:
            kw["cores"] = tuple(kw["cores"])
        return cls(**kw)
