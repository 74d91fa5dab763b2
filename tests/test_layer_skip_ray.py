"""Self-speculation on a tensor-parallel target (Ray actors, TP 2): every rank drafts with its heads' early
layers, rank 0 draws and broadcasts the tokens; greedy output is the target's and the outputs (greedy and seeded
sampled) and acceptance equal the in-process engine's."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TP_MAX_TOKENS, TP_PROMPTS, TPModels, ray_leftovers
from tests.test_eagle_ray import ray_cluster  # noqa: F401

pytestmark = pytest.mark.slow  # starts Ray and two worker processes

PARAMS = [SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(TP_PROMPTS) + [
    SamplingParams(max_tokens=TP_MAX_TOKENS, temperature=0.9, seed=50 + i, ignore_eos=True)
    for i in range(len(TP_PROMPTS))]


def test_tp2_layer_skip_equals_in_process(ray_cluster, tp_models: TPModels) -> None:  # noqa: F811
    spec = {"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3}
    runs = {}
    for name, kw in (("uni", {"distributed_executor_backend": "uni"}), ("tp2", {"tensor_parallel_size": 2})):
        llm = LLM(tp_models.target, spec, **kw)
        outs = [o.token_ids for o in llm.generate(TP_PROMPTS + TP_PROMPTS, PARAMS)]
        runs[name] = (outs, llm.engine.stats.num_accepted, llm.engine.stats.num_rounds)
        workers = llm.engine.executor.describe() if name == "tp2" else None
        llm.shutdown()
    assert runs["tp2"][0][: len(TP_PROMPTS)] == tp_models.expected
    assert runs["tp2"] == runs["uni"] and runs["uni"][1] > 0
    assert not ray_leftovers(workers, check_ray=False)
