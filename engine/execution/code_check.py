"""Workers on the controller's machine must run the controller's copy of the code.

Ray puts the driver's working directory first on a worker's sys.path, so ``specserve`` (the installed package)
started inside a checkout of another version would pair this controller with that checkout's workers, silently
(messages still decode; drafts and commits may not mean the same thing on both sides).
"""

from __future__ import annotations

from typing import Any

from engine.execution.role import Role
from engine.execution.worker_actor import code_root


def check_worker_code(actors: dict[Role, list[Any]], roles: list[Role]) -> None:
    """Raise a RuntimeError naming the rank and both folders when a worker on this node imports another copy."""
    import ray

    here, mine = ray.get_runtime_context().get_node_id(), code_root()
    hint = "Ray puts the working directory first on its workers' path"
    for role in roles:
        try:
            where = ray.get([a.code.remote() for a in actors[role]])
        except Exception as e:  # a worker of another version may lack ``code``
            raise RuntimeError(f"the {role} workers could not say where they import specserve from "
                               f"({type(e).__name__}): they probably run another copy than this controller "
                               f"({mine}); run from {mine} ({hint})") from None
        for rank, (node, theirs) in enumerate(where):
            if node == here and theirs != mine:
                raise RuntimeError(
                    f"the {role} worker rank {rank} imports specserve from {theirs}, this controller from {mine}: "
                    f"run from {mine} ({hint}), or set "
                    f"PYTHONPATH={theirs} and run `python -m engine.cli` so both use that copy")
