"""Placement plans from the parallel config, and what a cluster lacks for one (pure functions, no Ray)."""

from __future__ import annotations

import pytest

from engine.core.config import ParallelConfig
from engine.execution.placement import PlacementPlan, missing_resources, plan_placement


def test_gpu_cluster_gets_one_gpu_bundle_per_rank_in_rank_order() -> None:
    plan = plan_placement(8, 1, has_draft=True, cluster_gpus=9)
    assert plan.use_gpu and plan.resource == "GPU"
    assert plan.target_bundles == [{"GPU": 1.0}] * 8
    assert plan.draft_bundles == [{"GPU": 1.0}]
    assert plan.total == 9


def test_cpu_cluster_gets_cpu_bundles() -> None:
    plan = plan_placement(2, 2, has_draft=True, cluster_gpus=0)
    assert not plan.use_gpu and plan.resource == "CPU"
    assert plan.target_bundles == [{"CPU": 1.0}] * 2
    assert plan.draft_bundles == [{"CPU": 1.0}] * 2


def test_a_fraction_of_a_gpu_is_not_a_gpu_cluster() -> None:
    assert not plan_placement(1, 1, True, cluster_gpus=0.5).use_gpu
    assert plan_placement(1, 1, True, cluster_gpus=1).use_gpu


def test_no_draft_means_no_draft_bundles_whatever_its_size() -> None:
    plan = plan_placement(4, 2, has_draft=False, cluster_gpus=4)
    assert plan.draft_bundles == [] and plan.total == 4
    assert "draft" not in plan.describe()


def test_bundles_are_independent_dicts() -> None:
    plan = plan_placement(2, 1, True, 3)
    plan.target_bundles[0]["GPU"] = 0.5
    assert plan.target_bundles[1] == {"GPU": 1.0} and plan.draft_bundles[0] == {"GPU": 1.0}


def test_describe_says_what_is_needed_and_why() -> None:
    text = plan_placement(4, 2, True, 8).describe()
    assert "4 x {GPU: 1} on one node for the target (tensor_parallel_size=4)" in text
    assert "2 x {GPU: 1} for the draft (draft_tensor_parallel_size=2)" in text


def _gpu_plan(tp: int, draft_tp: int = 1, draft: bool = True) -> PlacementPlan:
    return plan_placement(tp, draft_tp, draft, cluster_gpus=1)


def test_enough_resources_on_one_node_is_placeable() -> None:
    assert missing_resources(_gpu_plan(8), {"GPU": 9.0}, [{"GPU": 9.0}]) is None


def test_draft_may_sit_on_another_node() -> None:
    assert missing_resources(_gpu_plan(2), {"GPU": 3.0}, [{"GPU": 1.0}, {"GPU": 2.0}]) is None


def test_too_few_in_total_names_the_count() -> None:
    why = missing_resources(_gpu_plan(8, 2), {"GPU": 9.0, "CPU": 64.0}, [{"GPU": 9.0}])
    assert why == "the cluster has 9 GPU, the plan needs 10"


def test_target_ranks_spread_over_nodes_are_refused() -> None:
    # 4 GPUs in total, but the 3 target ranks must share one node and no node has 3.
    why = missing_resources(_gpu_plan(3, draft=False), {"GPU": 4.0}, [{"GPU": 2.0}, {"GPU": 2.0}])
    assert why is not None
    assert "no node has 3 GPU for the target's ranks (largest: 2)" in why
    assert "must share a node" in why


def test_cpu_plan_counts_cpus() -> None:
    plan = plan_placement(2, 1, True, cluster_gpus=0)
    assert missing_resources(plan, {"CPU": 2.0}, [{"CPU": 2.0}]) == "the cluster has 2 CPU, the plan needs 3"
    assert missing_resources(plan, {"CPU": 16.0}, [{"CPU": 16.0}]) is None


def test_no_nodes_or_missing_resource_keys() -> None:
    assert missing_resources(_gpu_plan(1), {}, []) == "the cluster has 0 GPU, the plan needs 2"
    why = missing_resources(_gpu_plan(2), {"GPU": 3.0}, [{"CPU": 4.0}, {}])
    assert why is not None and "largest: 0" in why


@pytest.mark.parametrize(("tp", "draft_tp", "backend", "address", "resolved"), [
    (1, 1, None, None, "uni"),
    (2, 1, None, None, "ray"),
    (1, 2, None, None, "ray"),
    (1, 1, None, "auto", "ray"),
    (1, 1, "ray", None, "ray"),
])
def test_backend_resolution(tp: int, draft_tp: int, backend: str | None, address: str | None, resolved: str) -> None:
    cfg = ParallelConfig(tensor_parallel_size=tp, draft_tensor_parallel_size=draft_tp, backend=backend,
                         address=address)
    assert cfg.resolved_backend == resolved


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer in \\[1, 8\\]"),
    ({"tensor_parallel_size": 16}, "tensor_parallel_size must be an integer in \\[1, 8\\]"),
    ({"draft_tensor_parallel_size": 9}, "draft_tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "backend": "uni"}, "runs in one process"),
    ({"backend": "mp"}, "distributed_executor_backend must be one of"),
    ({"transport": "grpc"}, "transport must be one of"),
    ({"placement_timeout_s": 0}, "placement_timeout_s must be > 0"),
])
def test_parallel_config_refuses_with_the_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
