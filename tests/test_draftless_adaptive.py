"""The draftless methods under the adaptive policy (``adaptive: true``): greedy output equals no speculation,
the policy speculates where proposals are accepted, with or without a fallback draft model."""

from __future__ import annotations

import pytest

from engine.core.config import SpeculativeConfig, default_model_dirs
from engine.llm import LLM
from scheduler.adaptive import AdaptivePolicy
from scheduler.sampling_params import SamplingParams

PROMPTS = [[1] + [5, 6, 7, 8, 9] * 6, [1, 4, 2, 4, 2, 4, 2, 3], [1, 7, 4, 1, 7, 5, 2, 3, 9, 0, 6, 8, 10, 11]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("method", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
     "suffix_decoding_max_tree_depth": 6}])
def test_greedy_output_equals_no_speculation_under_the_adaptive_policy(small_vocab, method: dict) -> None:
    target, _ = small_vocab
    plain = LLM(target, None, max_model_len=64)
    try:
        want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.shutdown()
    llm = LLM(target, {**method, "adaptive": True, "adaptive_warmup_s": 1.0, "adaptive_cost_cache": False},
              max_model_len=64)
    try:
        assert isinstance(llm.engine.scheduler.policy, AdaptivePolicy)
        for _ in range(3):  # the policy learns across runs; the output never changes
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert llm.engine.stats.by_source[method["method"]].num_rounds > 0  # it did speculate
    finally:
        llm.shutdown()


def test_suffix_with_a_fallback_model_under_the_adaptive_policy() -> None:
    """``{"method": "suffix", "fallback": {model}, "adaptive": true}`` on the built-in pair: greedy output equals no
    speculation, and the rounds went to both sources, each counted in the metrics by source."""
    target, draft = default_model_dirs()
    prompts = [[1] + [5, 6, 7, 8, 9] * 6, [1, 40, 2, 41, 3, 42], [1, 7, 4, 1, 7, 5, 2, 3, 9, 0, 6, 8, 10, 11]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(target, None, max_model_len=128)
    try:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    cfg = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
           "fallback": {"model": draft, "num_speculative_tokens": 3}, "adaptive": True, "adaptive_warmup_s": 2.0,
           "adaptive_cost_cache": False}
    assert SpeculativeConfig.parse(dict(cfg)).is_adaptive  # no longer refused
    llm = LLM(target, cfg, max_model_len=128)
    try:
        policy = llm.engine.scheduler.policy
        assert isinstance(policy, AdaptivePolicy) and policy.sources is not None
        for _ in range(3):  # the policy learns across runs; the output never changes
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        by_source = llm.engine.stats.by_source
        assert by_source["suffix"].num_rounds > 0 and by_source["draft_model"].num_rounds > 0, by_source
    finally:
        llm.shutdown()
