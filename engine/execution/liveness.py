"""Is a worker still alive? Asked by every wait on a worker, whatever carries the messages.

Each worker actor runs one ``watch()`` call that never returns while the process lives. Ray fails that call's
reference as soon as it learns the actor died (the raylet sees the process exit; no heartbeat timeout is
involved), so ``check`` is a non-blocking ``ray.wait`` on a handful of references: cheap enough to ask every
fraction of a second while the controller waits for a reply on a zmq socket or on Ray call references.
"""

from __future__ import annotations

from typing import Any

from engine.execution.faults import WorkerDiedError
from engine.execution.role import Role

POLL_S = 0.25  # how often a wait asks; a death is noticed within this plus Ray's own notice (~1 s)


class LivenessWatch:
    def __init__(self) -> None:
        self._watches: dict[Role, list[Any]] = {}  # role -> one watch() reference per rank, in rank order

    def watch(self, role: Role, actors: list[Any]) -> None:
        self._watches[role] = [a.watch.remote() for a in actors]

    def forget(self, role: Role) -> None:
        self._watches.pop(role, None)

    def check(self, role: Role, waited_s: float | None = None) -> None:
        """Raise WorkerDiedError if any rank of ``role`` is gone."""
        import ray

        refs = self._watches.get(role)
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        if done:
            ref = done[0]
            raise WorkerDiedError(role, refs.index(ref), died_because(ref), waited_s)


def died_because(ref: Any) -> str:
    """Ray's account of why the call behind ``ref`` (already finished) cannot have a result."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError as e:
        return _first_line(e)
    except ray.exceptions.RayError as e:
        return f"{type(e).__name__}: {_first_line(e)}"
    return "its watch returned: the worker stopped"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
