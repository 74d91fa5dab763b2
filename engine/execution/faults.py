"""What can go wrong with a worker, as exceptions the engine can act on.

- ``WorkerDiedError``: a worker process (one rank of one role) is gone. Noticed within seconds whatever the
  transport (liveness.py); the engine can rebuild that role's worker group (recovery.py).
- ``WorkerStuckError``: every worker is alive but one did not answer within the per-step timeout. The last
  resort, never a substitute for detecting a death.
- ``TooManyRestartsError``: the restart budget is spent; names every failure that used it.

Tests inject faults that a kill from outside cannot time precisely through ``SPECSERVE_FAULT`` (forwarded to
the worker actors like every ``SPECSERVE_`` variable): ``injected_fault(name)`` reads ``name=N`` from it.

- ``draft_dies_before_laws=N``: draft rank 0 drops its N-th law frame and is killed (SIGKILL) a moment after
  the reply of that call has gone: the verifier waits for laws that will never come (engine/execution/worker_actor.py).
"""

from __future__ import annotations

import os

FAULT_ENV = "SPECSERVE_FAULT"


def injected_fault(name: str) -> int | None:
    """N from ``name=N`` in $SPECSERVE_FAULT (comma-separated), or None: no such fault is injected."""
    for item in os.environ.get(FAULT_ENV, "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == name:
            return int(value)
    return None


class WorkerDiedError(RuntimeError):
    def __init__(self, role: str, rank: int | None, cause: str, waited_s: float | None = None) -> None:
        self.role = role
        self.rank = rank
        self.cause = cause
        self.waited_s = waited_s  # how long the wait that noticed it had been running
        who = f"{role} rank {rank}" if rank is not None else f"a {role} worker"
        super().__init__(f"{who} died: {cause}")


class WorkerStuckError(TimeoutError):
    def __init__(self, role: str, timeout_s: float) -> None:
        self.role = role
        self.timeout_s = timeout_s
        super().__init__(f"no reply from the {role} workers within {timeout_s:g} s, although every {role} worker "
                         "is still alive: a stuck worker (--step-timeout is the last-resort limit)")


class TooManyRestartsError(RuntimeError):
    def __init__(self, failures: list[str], max_restarts: int, window_s: float) -> None:
        self.failures = list(failures)
        lines = "\n".join(f"  {i + 1}. {f}" for i, f in enumerate(self.failures))
        super().__init__(f"giving up: {len(self.failures)} worker failures within {window_s:g} s, more than "
                         f"max_worker_restarts={max_restarts}:\n{lines}")
