"""Where the workers run. The controller loop only talks to an ``Executor``.

Calls can be split into submit/wait so the draft works while the target verifies (pipelining); at most one
call per role is in flight. ``LocalExecutor`` keeps both workers in this process, the draft on a background
thread (torch releases the GIL in its kernels), for tests and tensor_parallel_size 1. ``RayExecutor``
(engine/execution/ray_executor.py) places them in Ray actors.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from engine.core.config import ParallelConfig
from workers.messages import DraftStep, DraftStepOutput, TargetStep, TargetStepOutput
from workers.worker_config import WorkerConfig


class Executor(Protocol):
    def submit_draft(self, msg: DraftStep) -> None: ...

    def wait_draft(self) -> DraftStepOutput: ...

    def submit_target(self, msg: TargetStep) -> None: ...

    def wait_target(self) -> TargetStepOutput: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, target: WorkerConfig, draft: WorkerConfig | None) -> None:
        from workers.draft_worker import DraftWorker
        from workers.target_worker import TargetWorker

        self.target = TargetWorker(target)
        if draft is not None and draft.eagle_target is not None:  # an EAGLE head: fed the target's features
            from workers.eagle.draft_worker import EagleDraftWorker

            self.draft: DraftWorker | None = EagleDraftWorker(draft)
            self.target.feed_eagle(self.draft.aux_layers, self.draft.features.put)
        else:
            self.draft = DraftWorker(draft) if draft is not None else None
        if self.draft is not None:
            # The draft's laws go straight to the verifier: the controller never holds them.
            self.draft.law_sink = self.target.law_store.put
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft") if draft is not None else None
        self._draft_future: Future | None = None
        self._draft_msg: DraftStep | None = None  # submitted, not started (submit_draft)
        self._target_msg: TargetStep | None = None

    def submit_draft(self, msg: DraftStep) -> None:
        # Held until a target call gives it something to overlap with (wait_target starts it on the pool thread);
        # waited for with no target call in between, it runs on the caller's thread. A second thread running
        # torch only pays when it overlaps: its own OpenMP team keeps spinning after each call and, on a machine
        # with as many threads as cores, slowed the plain steps that follow by ~40 % (SmolLM2, 2 threads).
        assert self.draft is not None and self._pool is not None, "draft call without a draft model"
        assert self._draft_future is None and self._draft_msg is None, "a draft call is already in flight"
        self._draft_msg = msg

    def wait_draft(self) -> DraftStepOutput:
        if self._draft_msg is not None:  # nothing overlapped it: run it here
            msg, self._draft_msg = self._draft_msg, None
            return self.draft.step(msg)
        assert self._draft_future is not None, "no draft call in flight"
        fut, self._draft_future = self._draft_future, None
        return fut.result()

    def submit_target(self, msg: TargetStep) -> None:
        # Runs in wait_target, on the caller's thread, so a draft submitted in between overlaps with it.
        assert self._target_msg is None, "a target call is already in flight"
        self._target_msg = msg

    def wait_target(self) -> TargetStepOutput:
        assert self._target_msg is not None, "no target call in flight"
        msg, self._target_msg = self._target_msg, None
        if self._draft_msg is not None:  # a pending draft call overlaps this target call
            draft_msg, self._draft_msg = self._draft_msg, None
            self._draft_future = self._pool.submit(self.draft.step, draft_msg)
        out = self.target.step(msg)
        if out.laws_error is not None:  # the in-process draft cannot die alone: only a stuck draft gets here
            raise RuntimeError(out.laws_error)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.target = None  # type: ignore[assignment]
        self.draft = None


def make_executor(parallel: ParallelConfig, target: WorkerConfig, draft: WorkerConfig | None,
                  draft_process: bool = False, draft_cores: list[int] | None = None,
                  target_cores: list[int] | None = None) -> Executor:
    # The workers' share of the parallel config: they receive only their own WorkerConfig.
    target = parallel.for_worker(target)
    draft = parallel.for_worker(draft) if draft is not None else None
    if parallel.resolved_backend == "uni":
        if draft is not None and draft_process:
            from engine.execution.draft_process import DraftProcessExecutor

            return DraftProcessExecutor(target, draft, draft_cores, target_cores)
        return LocalExecutor(target, draft)
    if draft_process:
        raise ValueError("speculative_config.draft_process is for tensor_parallel_size 1 on one machine: with Ray "
                         "the draft already runs in an actor of its own")
    from engine.execution.ray_executor import RayExecutor

    return RayExecutor(parallel, target, draft)
