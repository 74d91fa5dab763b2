"""Preemption with the draft in its own Ray actor and the target split over 2 ranks: the draft's cache is rebuilt.

A KV pool too small for the batch forces the scheduler to preempt and recompute requests mid-decode. The draft
(here the target itself, so it proposes what the target would) must drop the victim's state on its actor and
re-prefill it like the target does; a draft that kept stale KV or block tables, or lost its place, would propose
worse and worse after each preemption while verification kept the output exact. So: outputs, and each request's
drafted and accepted counts, equal a run with a pool large enough never to preempt; greedy requests accept every
drafted token (draft == target); and the small pool did preempt.

One Ray cluster and two engines (seconds each to start on a CPU): the slowest test file is bounded by that.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_PROMPTS, TPModels

pytestmark = pytest.mark.slow  # a Ray cluster

MAX_TOKENS = 40  # long enough that a request is preempted after several accepted rounds
BLOCK = 8
SMALL_POOL = 64  # tokens: 8 blocks for 6 requests of up to 13 + 40 + 3 tokens (7 blocks each): must preempt
PARAMS = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(TP_PROMPTS) + [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.6, top_p=0.9, seed=2000 + i, ignore_eos=True)
    for i in range(len(TP_PROMPTS))]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _run(models: TPModels, num_kv_tokens: int | None) -> tuple[list, int]:
    """(outputs, preemptions) of a TP 2 engine whose draft is the target itself, in a Ray actor of its own."""
    llm = LLM(models.target, {"method": "draft_model", "model": models.target, "num_speculative_tokens": 3,
                              "adaptive": False},
              distributed_executor_backend="ray", tensor_parallel_size=2, block_size=BLOCK,
              num_kv_tokens=num_kv_tokens)
    try:
        sched = llm.engine.scheduler
        count = [0]
        preempt = sched._preempt

        def counted(req) -> None:  # the scheduler keeps no preemption counter of its own
            count[0] += 1
            preempt(req)

        sched._preempt = counted
        outs = llm.generate(TP_PROMPTS + TP_PROMPTS, PARAMS)
    finally:
        llm.shutdown()
    return outs, count[0]


def test_preempted_requests_draft_as_well_as_never_preempted(ray_cluster, tp_models: TPModels) -> None:
    roomy, roomy_preemptions = _run(tp_models, None)
    tight, tight_preemptions = _run(tp_models, SMALL_POOL)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0, "the small pool must force preemption, or this test checks nothing"
    for i, (a, b) in enumerate(zip(roomy, tight, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i}: output changed by preemption"
        for key in ("rounds", "drafted_tokens", "accepted_tokens"):
            assert b.metrics[key] == a.metrics[key], f"request {i}: {key} {b.metrics[key]} after preemption, " \
                                                     f"{a.metrics[key]} without"
    for out in tight[: len(TP_PROMPTS)]:  # greedy, draft == target: every drafted token is the target's argmax
        assert out.metrics["drafted_tokens"] > 0
        assert out.metrics["accepted_tokens"] == out.metrics["drafted_tokens"], out.metrics
