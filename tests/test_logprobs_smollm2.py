"""On the real SmolLM2-135M (its GGUF dequantized, float32): echo's prompt logprobs equal transformers' within 1e-3,
and greedy logprobs with speculation (the shipped SmolLM2 draft) equal those without it within 1e-3 (bitwise in
fact: the row-invariant path)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.helpers_gguf import smollm2_path

pytestmark = pytest.mark.slow  # loads SmolLM2 three times (~1 min on the shared machine)

PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_smollm2_prompt_logprobs_equal_transformers_and_speculation_changes_nothing() -> None:
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    outs = {}
    draft = {"method": "draft_model", "model": str(DEFAULT_MODELS_DIR / "smollm2-draft"),
             "num_speculative_tokens": 3, "adaptive": False}  # every round drafts 3
    for name, spec in (("plain", "none"), ("spec", draft)):
        with LLM(path, spec, quantization="none", dtype="float32") as llm:
            outs[name] = llm.generate([PROMPT], params)[0]
    plain, sped = outs["plain"], outs["spec"]
    assert plain.token_ids == sped.token_ids
    assert sped.metrics["accepted_tokens"] > 0 and sped.metrics["rounds"] > 0
    assert max(abs(a.logprob - b.logprob) for a, b in zip(plain.logprobs, sped.logprobs, strict=True)) < 1e-3

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = plain.prompt_token_ids + plain.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    n = len(plain.prompt_token_ids)
    for pos in range(1, n):
        e = plain.prompt_logprobs[pos]
        assert abs(e.logprob - ref[pos - 1, ids[pos]].item()) < 1e-3, pos
        assert {i for i, _ in e.top} == set(ref[pos - 1].topk(5).indices.tolist()), pos
    for j, e in enumerate(plain.logprobs):
        assert abs(e.logprob - ref[n - 1 + j, ids[n + j]].item()) < 1e-3, j
