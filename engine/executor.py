"""Where the workers run. The controller loop only ever calls ``draft_step`` and ``target_step``.

``LocalExecutor`` keeps both workers in this process (one machine, no Ray: tests and the default for
tensor_parallel_size 1). ``RayExecutor`` (engine/ray_executor.py) places them in Ray actors.
"""

from __future__ import annotations

from typing import Protocol

from engine.config import ParallelConfig
from workers.messages import DraftStep, TargetStep, TargetStepOutput
from workers.verification import CandidateTree
from workers.worker_config import WorkerConfig


class Executor(Protocol):
    def draft_step(self, msg: DraftStep) -> list[CandidateTree]: ...

    def target_step(self, msg: TargetStep) -> TargetStepOutput: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, target: WorkerConfig, draft: WorkerConfig | None) -> None:
        from workers.draft_worker import DraftWorker
        from workers.target_worker import TargetWorker

        self.target = TargetWorker(target)
        self.draft = DraftWorker(draft) if draft is not None else None

    def draft_step(self, msg: DraftStep) -> list[CandidateTree]:
        assert self.draft is not None, "draft_step without a draft model"
        return self.draft.step(msg)

    def target_step(self, msg: TargetStep) -> TargetStepOutput:
        return self.target.step(msg)

    def shutdown(self) -> None:
        self.target = None  # type: ignore[assignment]
        self.draft = None


def make_executor(parallel: ParallelConfig, target: WorkerConfig, draft: WorkerConfig | None) -> Executor:
    if parallel.resolved_backend == "uni":
        return LocalExecutor(target, draft)
    from engine.ray_executor import RayExecutor

    return RayExecutor(parallel, target, draft)
