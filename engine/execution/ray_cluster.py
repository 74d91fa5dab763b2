"""The Ray side of placement: joining or starting a cluster, and reserving each role's placement group.

``placement.py`` decides what to ask for (pure functions); this module asks Ray for it and, when the cluster
cannot hold it within ``placement_timeout_s``, says what is missing.
"""

from __future__ import annotations

import os
from typing import Any

from engine.core.config import ParallelConfig
from engine.execution.loopback import ray_on_loopback
from engine.execution.placement import PlacementPlan, missing_resources
from engine.execution.role import Role


def init_ray(parallel: ParallelConfig, has_draft: bool) -> None:
    """Join ``parallel.address``, or start a local cluster sized for the plan."""
    import ray

    if parallel.address:
        ray.init(address=parallel.address, log_to_driver=False)
    else:
        # A local cluster must offer one CPU bundle per worker even on a 2-core machine: bundles are
        # reservations, and these workers mostly wait on each other. address="local": without it,
        # ray.init joins any cluster `ray start` left on this machine (and refuses num_cpus there).
        bundles = parallel.tensor_parallel_size + (parallel.draft_tensor_parallel_size if has_draft else 0)
        with ray_on_loopback():  # nothing of this cluster listens beyond this machine (no dashboard either)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, bundles), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)


class PlacementGroups:
    """One placement group per role, reserved before any worker starts and removed with its workers."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[Role, Any] = {}

    def reserve(self, plan: PlacementPlan, specs: dict[Role, tuple[list[dict[str, float]], str]]) -> list[Any]:
        """One placement group per role (target first: its STRICT_PACK group is the harder one to place)."""
        import ray
        from ray.util.placement_group import placement_group

        groups = []
        for role, (bundles, strategy) in specs.items():
            pg = placement_group(bundles, strategy=strategy)
            self._groups[role] = pg
            groups.append(pg)
        try:
            ray.get([pg.ready() for pg in groups], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove(list(specs))
            raise RuntimeError(placement_error(plan, self.timeout_s)) from None
        return groups

    def remove(self, roles: list[Role]) -> None:
        from ray.util.placement_group import remove_placement_group

        for role in roles:
            pg = self._groups.pop(role, None)
            if pg is None:
                continue
            try:
                remove_placement_group(pg)
            except Exception:
                pass

    def remove_all(self) -> None:
        self.remove(list(self._groups))


def placement_error(plan: PlacementPlan, timeout: float) -> str:
    """Why the plan could not be placed: what the cluster lacks in total, or else that others hold it."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    res = plan.resource
    why = missing_resources(plan, total, nodes)
    if why is None:
        free = ray.available_resources().get(res, 0.0)
        why = (f"the cluster has enough {res} in total but only {free:g} free: other jobs or engines hold the "
               "rest")
    return (f"could not place the workers within {timeout:g} s: {why}. Needed: {plan.describe()}. Cluster: "
            f"{total.get('CPU', 0.0):g} CPU, {total.get('GPU', 0.0):g} GPU on {len(nodes)} node(s). Lower "
            "tensor_parallel_size / draft_tensor_parallel_size, or add nodes.")
