"""The ``ngram`` method: vLLM's keys and defaults, prompt lookup's proposals, and greedy output equal to no
speculation through the engine (proposals counted, so the equality is not that of plain decoding)."""

from __future__ import annotations

import pytest

from engine.core.args import EngineArgs
from engine.core.config import SpeculativeConfig, default_model_dirs
from engine.drafting.draftless_config import NgramConfig
from engine.drafting.ngram import NgramProposer
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import marked_slow

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Repetitive prompts: the tiny targets continue them by copying part of the time.
PROMPTS = [[1] + [5, 6, 7, 8, 9] * 6,
           [1, 40, 41, 42, 40, 41, 42, 40, 41], [1, 17, 44, 9, 83], [1] + list(range(20, 32)) * 2]


def test_vllm_defaults_and_validation() -> None:
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.model, cfg.draft_spec) == (5, 5, None, None)
    assert not cfg.is_adaptive and cfg.tree_shape.branching == (1, 1, 1, 1)
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4,
                                 "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="pipeline"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "pipeline": True})
    with pytest.raises(ValueError, match="fallback is for"):
        SpeculativeConfig.parse({"model": "x", "fallback": {"model": "y"}})
    # The CLI's path: a built-in target adds its draft's path, which a draftless method does not use.
    engine_cfg = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').to_engine_config()
    assert engine_cfg.speculative.method == "ngram" and engine_cfg.speculative.draft_spec is None


def _proposer(k: int = 3, lo: int = 2, hi: int = 4) -> NgramProposer:
    return NgramProposer(NgramConfig(k, lo, hi))


def test_lookup_takes_the_longest_then_most_recent_match() -> None:
    p = _proposer(k=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    toks = [9, 1, 2, 3, 50, 51, 7, 2, 3, 60, 61, 1, 2, 3]
    # "1 2 3" (length 3) occurred at 1..3, followed by 50 51 7; "2 3" alone also at 7..8 (more recent, shorter).
    assert p.propose(0, toks, 8, 8) == ([50, 51, 7], [-1, 0, 1])
    # Only a 2-gram match: the most recent one.
    assert p.propose(1, [2, 3, 70, 2, 3, 71, 8, 2, 3], 8, 8)[0] == [71, 8, 2]


def test_no_match_proposes_nothing_and_budgets_cut_the_chain() -> None:
    p = _proposer(k=5)
    assert p.propose(0, [1, 2, 3, 4, 5, 6], 8, 8) == ([], [])
    toks = [1, 2, 3, 4, 5, 6, 1, 2]
    assert p.propose(1, toks, 8, 8)[0] == [3, 4, 5, 6, 1]
    assert p.propose(1, toks, 2, 8)[0] == [3, 4]  # the round's reserved nodes
    assert p.propose(1, toks, 8, 1)[0] == [3]  # its depth
    # Incremental: new tokens extend the index; a request that left starts over.
    assert p.propose(1, toks + [3, 4], 8, 8)[0] == [5, 6, 1, 2, 3]
    p.forget(1)
    assert p.num_requests == 1


@pytest.mark.parametrize("family", marked_slow(["llama", "qwen3", "builtin"], {"builtin"}))
def test_greedy_output_equals_no_speculation(request: pytest.FixtureRequest, family: str) -> None:
    target = default_model_dirs()[0] if family == "builtin" else request.getfixturevalue(family).target
    plain = [o.token_ids for o in LLM(target, None, block_size=4).generate(PROMPTS, GREEDY)]
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(target, cfg, block_size=4, num_kv_tokens=256)  # small: requests are preempted and recomputed
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    stats = llm.engine.stats
    assert stats.num_rounds > 10 and stats.num_plain_rounds > 0, stats.as_dict()  # proposals, and misses
    assert stats.by_source["ngram"].num_rounds == stats.num_rounds
    assert llm.engine.executor.draft is None  # no draft worker
