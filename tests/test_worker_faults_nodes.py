"""Node loss on a fake multi-node Ray cluster (several raylets on this machine, GPUs declared but absent, so the
workers run on the CPU): the draft's node goes away and the draft moves to another node while every request
completes identically; then the target's node goes away and nothing else can hold the target's ranks, so the
engine stops with a placement error that says what is missing."""

from __future__ import annotations

import time

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_MAX_TOKENS, TP_PROMPTS, TPModels

pytestmark = pytest.mark.slow  # a two-node Ray cluster

GREEDY = SamplingParams(max_tokens=3 * TP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=3 * TP_MAX_TOKENS, temperature=0.9, top_p=0.95, seed=3000 + i, ignore_eos=True)
          for i in range(len(TP_PROMPTS))]
SPEC = {"num_speculative_tokens": 3}


def speculative(models: TPModels) -> dict:
    return {"method": "draft_model", "model": models.draft, **SPEC}


@pytest.fixture(scope="module")
def seeded_reference(tp_models: TPModels) -> list[list[int]]:
    """The seeded sampled requests' outputs in-process: no Ray, no fault (draws are keyed by seed and position,
    so the Ray engine gives the same tokens as long as the draft proposes the same ones)."""
    with LLM(tp_models.target, speculative(tp_models), distributed_executor_backend="uni") as llm:
        return [o.token_ids for o in llm.generate(TP_PROMPTS, SEEDED)]


@pytest.fixture(scope="module")
def cluster():
    """Head: the driver only. T: 2 GPUs (the target's ranks). B: 1 GPU (the draft). C (added later): 1 GPU."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # A lost node is declared dead after missed health checks (15 s by default): 1.5 s here, so the placement
    # error below sees the cluster without it.
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    ray._common.utils.reset_ray_address()  # other ray.init() calls on this machine must not join it
    nodes = {"T": c.add_node(num_cpus=1, num_gpus=2), "B": c.add_node(num_cpus=1, num_gpus=1)}
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_node_loss(cluster, tp_models: TPModels, seeded_reference: list[list[int]]) -> None:
    c, nodes = cluster
    with LLM(tp_models.target, speculative(tp_models), tensor_parallel_size=2,
             placement_timeout_s=10) as llm:
        engine = llm.engine

        def node_of(role: str) -> set[str]:
            return {w["node_id"] for w in engine.executor.describe() if w["role"] == role}

        assert node_of("draft") == {nodes["B"].node_id} and node_of("target") == {nodes["T"].node_id}
        for i, p in enumerate(TP_PROMPTS):
            engine.add_request(str(i), p, GREEDY)
            engine.add_request(f"seeded-{i}", p, SEEDED[i])  # held while the draft is down, then identical
        outs: dict[str, list[int]] = {}
        engine.step_finished()
        nodes["C"] = c.add_node(num_cpus=1, num_gpus=1)
        c.wait_for_nodes()
        c.remove_node(nodes["B"], allow_graceful=False)
        deadline = time.monotonic() + 240
        stats = engine.recovery.stats
        extra = 0
        # On an idle machine the requests can finish before the lost node is noticed: keep work coming (each
        # extra batch with the same prompts) until the draft's loss has been handled and everything is done.
        while engine.has_unfinished or not stats.restarts or not engine.draft_up:
            assert time.monotonic() < deadline, stats.as_dict()
            if not engine.has_unfinished:
                for i, p in enumerate(TP_PROMPTS):
                    engine.add_request(f"more-{extra}-{i}", p, GREEDY)
                extra += 1
            for o in engine.step_finished():
                outs[o.request_id] = o.token_ids
        assert stats.restarts == {"draft": 1}
        for k in range(extra):  # the requests that kept the engine busy are exact too
            assert [outs[f"more-{k}-{i}"][:TP_MAX_TOKENS] for i in range(len(TP_PROMPTS))] == tp_models.expected
        assert node_of("draft") == {nodes["C"].node_id}
        assert [outs[str(i)][:TP_MAX_TOKENS] for i in range(len(TP_PROMPTS))] == tp_models.expected
        assert [outs[f"seeded-{i}"] for i in range(len(TP_PROMPTS))] == seeded_reference

        # The target's node goes: no node has 2 GPUs any more.
        for i, p in enumerate(TP_PROMPTS):
            engine.add_request(f"again-{i}", p, GREEDY)
        engine.step_finished()
        c.remove_node(nodes["T"], allow_graceful=False)
        with pytest.raises(RuntimeError, match="restarting the target workers: could not place.*the plan needs 2"):
            # As above: the requests can finish before the loss is noticed, so keep work coming until it is.
            while True:
                assert time.monotonic() < deadline
                if not engine.has_unfinished:
                    for i, p in enumerate(TP_PROMPTS):
                        engine.add_request(f"again-{extra}-{i}", p, GREEDY)
                    extra += 1
                engine.step_finished()
