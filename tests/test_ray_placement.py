"""Where Ray puts the workers, on clusters that declare GPUs this machine does not have.

Ray hands out the declared GPU ids (CUDA_VISIBLE_DEVICES) as if they were real; the workers find no CUDA and
fall back to the CPU with Gloo, so placement is tested for real and generation still runs. Rules under test
(engine/execution/placement.py): one bundle per rank, the target's ranks packed on one node in rank order, the draft
in its own group anywhere, and a plan the cluster cannot hold refused in bounded time with what is missing,
leaving no actor or placement group behind.
"""

from __future__ import annotations

import json
import time

import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_MAX_TOKENS, TP_PROMPTS, TPModels, ray_leftovers
from tests.helpers_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # Ray clusters

GREEDY = SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.8, seed=2000 + i, ignore_eos=True)
           for i in range(len(TP_PROMPTS))]
TREE = {"num_speculative_tokens": 3, "tree_branching": [2, 1, 1]}
CHAIN = {"num_speculative_tokens": 3}
PLACEMENT_TIMEOUT_S = 3.0
SHIPPED = DEFAULT_MODELS_DIR
SHIPPED_MAX_TOKENS = 12


def draft_config(models: TPModels, shape: dict, **extra) -> dict:
    return {"method": "draft_model", "model": models.draft, **shape, **extra}


def generate(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, [GREEDY] * len(TP_PROMPTS) + SAMPLED)]
    return outs[: len(TP_PROMPTS)], outs[len(TP_PROMPTS):]


def refused(models: TPModels, **kwargs) -> tuple[str, float]:
    """The error and the seconds it took for an engine the cluster cannot place."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        LLM(models.target, distributed_executor_backend="ray", placement_timeout_s=PLACEMENT_TIMEOUT_S, **kwargs)
    return str(err.value), time.monotonic() - start


@pytest.fixture(scope="module")
def shipped_reference() -> tuple[list[str], list[list[int]]]:
    """Two shipped prompts and the in-process shipped target's greedy output without speculation (TP 1)."""
    with open(SHIPPED / "prompts.jsonl", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][:2]
    with LLM(str(SHIPPED / "target"), "none") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=SHIPPED_MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


@pytest.fixture(scope="class")
def nine_gpus():
    """A local Ray that declares 9 GPUs on this (GPU-less) machine."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, num_gpus=9, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="class")
def two_nodes():
    """Two Ray nodes on this machine: A (the head) with 1 GPU, B with 2."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 1, "include_dashboard": False})
    # Cluster records its address in /tmp/ray/ray_current_cluster, where any ray.init() without an address
    # on this machine would find and join it: forget it, so tests running beside this one are not affected.
    ray._common.utils.reset_ray_address()
    cluster.add_node(num_cpus=4, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.usefixtures("nine_gpus")
class TestOneNodeWithNineGPUs:
    @pytest.mark.slow
    def test_tp8_and_a_draft_take_one_gpu_bundle_each(self, shipped_reference) -> None:
        # The shipped pair (its target widened to 16 / 8 heads so that it splits 8 ways: training/widen_heads.py):
        # placement, and the greedy output of real weights verified at TP 8 against TP 1 without speculation. One
        # TP 8 engine for both (nine actors on two cores is the slowest start-up in the suite).
        prompts, expected = shipped_reference
        llm = LLM(str(SHIPPED / "target"), {"model": str(SHIPPED / "draft"), **CHAIN, "adaptive": False},
                  tensor_parallel_size=8)
        try:
            workers = llm.engine.executor.describe()
            target = sorted((w for w in workers if w["role"] == "target"), key=lambda w: w["rank"])
            draft = [w for w in workers if w["role"] == "draft"]
            assert len(target) == 8 and len(draft) == 1
            # Rank i holds bundle i of the target's group (rank order is bundle order), all on one node.
            assert [w["bundle_index"] for w in target] == list(range(8))
            assert [w["world_size"] for w in target] == [8] * 8
            assert draft[0]["bundle_index"] == 0 and draft[0]["world_size"] == 1
            assert len({w["node_id"] for w in target}) == 1
            assert target[0]["placement_group_id"] != draft[0]["placement_group_id"]
            # One declared GPU each, none shared; no CUDA here, so every worker runs on the CPU.
            assert all(len(w["gpu_ids"]) == 1 for w in workers)
            assert len({w["gpu_ids"][0] for w in workers}) == 9
            assert {w["device"] for w in workers} == {"cpu"}
            # Greedy only: seeded sampling through Ray == in-process is tests/test_ray_executor.py's (TP 2 and 4).
            greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(
                max_tokens=SHIPPED_MAX_TOKENS, temperature=0.0, ignore_eos=True))]
            accepted = llm.engine.stats.num_accepted
        finally:
            llm.shutdown()
        assert ray_leftovers(workers) == []
        assert greedy == expected
        assert accepted > 0  # speculation really ran: the ranks ran verification forwards, not only decode

    def test_more_gpus_than_the_cluster_has_is_refused(self, tp_models: TPModels) -> None:
        message, seconds = refused(tp_models, speculative_config=draft_config(
            tp_models, CHAIN, draft_tensor_parallel_size=2), tensor_parallel_size=8)
        assert "the cluster has 9 GPU, the plan needs 10" in message
        assert "tensor_parallel_size=8" in message and "draft_tensor_parallel_size=2" in message
        assert seconds < PLACEMENT_TIMEOUT_S + 30
        assert ray_leftovers() == []

    def test_gpus_held_by_someone_else_are_reported_as_busy(self, tp_models: TPModels) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group

        other = placement_group([{"GPU": 1.0}] * 6)  # another job holds 6 of the 9
        try:
            import ray

            ray.get(other.ready(), timeout=60)
            message, seconds = refused(tp_models, speculative_config=draft_config(tp_models, CHAIN),
                                       tensor_parallel_size=4)
        finally:
            remove_placement_group(other)
        assert "enough GPU in total but only" in message and "other jobs or engines hold the rest" in message
        assert seconds < PLACEMENT_TIMEOUT_S + 30
        assert ray_leftovers() == []


@pytest.mark.usefixtures("two_nodes")
class TestTwoNodes:
    """Node A (the head) declares 1 GPU, node B 2: a TP=2 target fits only on B, so the draft must go to A."""

    def test_draft_and_target_on_different_nodes(self, tp_models: TPModels) -> None:
        import ray

        gpus_by_node = {n["NodeID"]: n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]}
        llm = LLM(tp_models.target, draft_config(tp_models, CHAIN), tensor_parallel_size=2)
        try:
            workers = llm.engine.executor.describe()
            greedy, _ = generate(llm)
        finally:
            llm.shutdown()
        assert ray_leftovers(workers) == []
        target = [w for w in workers if w["role"] == "target"]
        draft = [w for w in workers if w["role"] == "draft"]
        assert {gpus_by_node[w["node_id"]] for w in target} == {2}
        assert {gpus_by_node[w["node_id"]] for w in draft} == {1}
        assert sorted(w["bundle_index"] for w in target) == [0, 1]
        assert greedy == tp_models.expected

    def test_target_ranks_are_never_split_across_nodes(self, tmp_path) -> None:
        # 3 GPUs in the cluster, but not 3 on one node. The model splits over 3 ranks (heads are checked
        # before placement), so what fails is the placement.
        target = make_tiny_checkpoint(tmp_path / "tp3", family="llama", vocab_size=96, seed=7, hidden_size=48,
                                      num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                      intermediate_size=96, num_hidden_layers=1)
        message, seconds = refused(TPModels(target, target, []), tensor_parallel_size=3)
        assert "no node has 3 GPU for the target's ranks (largest: 2)" in message
        assert "2 node(s)" in message
        assert seconds < PLACEMENT_TIMEOUT_S + 30
        assert ray_leftovers() == []
