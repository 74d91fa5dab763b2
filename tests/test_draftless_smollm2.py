"""Draftless methods on the real SmolLM2-135M-Instruct Q4_1 GGUF, on two copy-heavy prompts of the benchmark
workload: greedy output equals no speculation (ngram, suffix, suffix in front of the shipped draft), and the
proposals happened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.helpers_gguf import smollm2_path

pytestmark = pytest.mark.slow  # the real SmolLM2 model

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
WORKLOAD = Path(__file__).resolve().parents[1] / "benchmarks" / "copy_heavy_prompts.jsonl"


def test_smollm2_greedy_equals_no_speculation() -> None:
    smol = smollm2_path()
    rows = [json.loads(line) for line in WORKLOAD.read_text(encoding="utf-8").splitlines()[:2]]
    prompts = [r["prompt"] for r in rows]
    plain = [o.token_ids for o in LLM(smol, None).generate(prompts, GREEDY)]
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
        "suffix-fallback": {"method": "suffix", "num_speculative_tokens": 8, "fallback": {
            "model": str(DEFAULT_MODELS_DIR / "smollm2-draft"), "num_speculative_tokens": 3}},
    }
    for name, cfg in configs.items():
        llm = LLM(smol, cfg)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain, name
        assert llm.engine.stats.num_rounds > 3 and llm.engine.stats.num_accepted > 0, (name, llm.engine.stats.as_dict())
