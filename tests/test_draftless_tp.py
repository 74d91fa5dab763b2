"""Draftless methods on a tensor-parallel target in Ray actors: greedy output is no speculation's, and seeded
sampled output is the in-process engine's (the one-hot laws are built on the verifying rank from the ints)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import TPModels

pytestmark = pytest.mark.slow  # a Ray cluster

PROMPTS = [[1] + [5, 6, 7, 8, 9] * 4, [1, 40, 41, 42, 40, 41, 43, 40, 41], [1, 17, 44, 9, 83]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PARAMS = [GREEDY] * len(PROMPTS) + [SamplingParams(max_tokens=16, temperature=0.9, seed=500 + i, ignore_eos=True)
                                    for i in range(len(PROMPTS))]


def _run(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS * 2, PARAMS)]


def test_tp2_draftless_greedy_equals_no_speculation(tp_models: TPModels) -> None:
    plain = [o.token_ids for o in LLM(tp_models.target, None).generate(PROMPTS, GREEDY)]
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "suffix-fallback": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0,
                            "fallback": {"model": tp_models.draft, "num_speculative_tokens": 2}},
    }
    for name, cfg in configs.items():
        in_process = _run(LLM(tp_models.target, cfg))
        llm = LLM(tp_models.target, cfg, tensor_parallel_size=2)
        try:
            out = _run(llm)
            stats = llm.engine.stats
        finally:
            llm.shutdown()
        assert out[: len(PROMPTS)] == plain, name
        assert out == in_process, name
        assert stats.num_rounds > 5, (name, stats.as_dict())
