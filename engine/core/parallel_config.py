"""How the engine's workers are placed and run: tensor-parallel sizes, the executor backend, worker recovery."""

from __future__ import annotations

from dataclasses import dataclass, replace

from workers.worker_config import WorkerConfig

EXECUTOR_BACKENDS = ("uni", "ray")
TRANSPORTS = ("zmq", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    # "uni": workers in this process (only with tensor_parallel_size 1); "ray": Ray actors.
    # None picks "ray" when tensor parallelism or a cluster address asks for it.
    backend: str | None = None
    address: str | None = None  # an existing Ray cluster; None starts a local one when Ray is used
    transport: str = "zmq"  # per-round messages: msgpack over zmq, or plain Ray actor calls
    placement_timeout_s: float = 60.0
    # Ray workers (or a draft process) that die are replaced up to this many times per window
    # (engine/execution/recovery.py); 0: never.
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 600.0
    # The last resort for a worker that is alive but does not answer one step (a dead one is noticed within about
    # a second); also how long the verifier waits for a live draft's laws and a replacement draft may take to start.
    step_timeout_s: float = 600.0
    worker_threads: int = 1  # torch CPU threads per worker process (a draft process pinned to cores: one per core)

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        t = self.worker_threads
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"worker_threads must be an integer >= 1, got {t!r}")
        r = self.max_worker_restarts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"max_worker_restarts must be an integer >= 0, got {r!r}")
        if not self.worker_restart_window_s > 0:
            raise ValueError(f"worker_restart_window_s must be > 0, got {self.worker_restart_window_s!r}")
        for name in ("tensor_parallel_size", "draft_tensor_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 8:
                raise ValueError(f"{name} must be an integer in [1, 8], got {v!r}")
        if self.backend is not None and self.backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.resolved_backend == "uni" and (self.tensor_parallel_size > 1 or self.draft_tensor_parallel_size > 1):
            raise ValueError("distributed_executor_backend 'uni' runs in one process: tensor_parallel_size and "
                             "draft_tensor_parallel_size must be 1 (use 'ray')")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s}")

    @property
    def resolved_backend(self) -> str:
        if self.backend is not None:
            return self.backend
        wants_ray = self.tensor_parallel_size > 1 or self.draft_tensor_parallel_size > 1 or self.address
        return "ray" if wants_ray else "uni"

    def for_worker(self, config: WorkerConfig) -> WorkerConfig:
        """``config`` carrying this config's share for a worker: its step timeout and torch thread count."""
        return replace(config, step_timeout_s=self.step_timeout_s, num_threads=self.worker_threads)
