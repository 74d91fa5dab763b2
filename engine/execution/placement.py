"""Ray placement derived from the parallel config (pure functions: no Ray calls, easy to test).

The target's tensor-parallel ranks need a fast link, so their bundles form one STRICT_PACK placement group
(one node). The draft has its own group and may land on any node. One bundle per worker process: a GPU when
the cluster has GPUs, a CPU otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.execution.role import Role


@dataclass(frozen=True)
class PlacementPlan:
    use_gpu: bool
    target_bundles: list[dict[str, float]]  # one per target rank, in rank order
    draft_bundles: list[dict[str, float]]  # one per draft rank (empty: no draft)

    @property
    def resource(self) -> str:
        return "GPU" if self.use_gpu else "CPU"

    @property
    def total(self) -> int:
        return len(self.target_bundles) + len(self.draft_bundles)

    def bundles(self, role: Role) -> list[dict[str, float]]:
        return self.target_bundles if role == Role.TARGET else self.draft_bundles

    def only(self, role: Role) -> PlacementPlan:
        """This plan without the other role's bundles: what restarting ``role`` alone needs."""
        return replace(self, **{"draft_bundles" if role == Role.TARGET else "target_bundles": []})

    def describe(self) -> str:
        parts = [f"{len(self.target_bundles)} x {{{self.resource}: 1}} on one node for the target "
                 f"(tensor_parallel_size={len(self.target_bundles)})"]
        if self.draft_bundles:
            parts.append(f"{len(self.draft_bundles)} x {{{self.resource}: 1}} for the draft "
                         f"(draft_tensor_parallel_size={len(self.draft_bundles)})")
        return " and ".join(parts)


def plan_placement(tensor_parallel_size: int, draft_tensor_parallel_size: int, has_draft: bool,
                   cluster_gpus: float) -> PlacementPlan:
    use_gpu = cluster_gpus >= 1
    bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    return PlacementPlan(
        use_gpu=use_gpu,
        target_bundles=[dict(bundle) for _ in range(tensor_parallel_size)],
        draft_bundles=[dict(bundle) for _ in range(draft_tensor_parallel_size)] if has_draft else [],
    )


def missing_resources(plan: PlacementPlan, cluster: dict[str, float],
                      per_node: list[dict[str, float]]) -> str | None:
    """What a cluster with these resources lacks for ``plan`` (None if it could hold it), for error messages.

    ``cluster`` / ``per_node``: resource totals (what the cluster could ever offer) or what is free now.
    """
    need = plan.total
    have = cluster.get(plan.resource, 0.0)
    if have < need:
        return f"the cluster has {have:g} {plan.resource}, the plan needs {need}"
    best_node = max((n.get(plan.resource, 0.0) for n in per_node), default=0.0)
    if best_node < len(plan.target_bundles):
        return (f"no node has {len(plan.target_bundles)} {plan.resource} for the target's ranks "
                f"(largest: {best_node:g}); tensor-parallel ranks must share a node")
    return None
