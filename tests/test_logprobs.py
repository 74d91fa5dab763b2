"""Logprobs are the target's, for every emitted token (accepted, recovered, bonus) and for the prompt (echo).

References: (1) the engine's own prefill of the whole sequence (prompt + output) asking for prompt logprobs: a
row-invariant path (workers/row_invariant.py: a prefill row, a verify node and a decode row run the identical
code), so the values must agree bit for bit; (2) transformers' float32 forward of the same sequence, a different
set of kernels, so within 1e-4. Speculation on and off (greedy) give bitwise the same values.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.llm import LLM
from scheduler.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.conftest import spec

PROMPTS = [[1, 17, 44, 9, 83], [1] + list(range(20, 45))]
K = 5


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: transformers' log_softmax after each position but the last, float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def rescored(target: str, prompt: list[int], output: list[int], k: int = K):
    """The engine's prompt logprobs of prompt + output (one prefill, no speculation, no cache)."""
    with LLM(target, None) as llm:
        out = llm.generate([prompt + output], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))[0]
    return out.prompt_logprobs[len(prompt):]


def record_outcomes(engine) -> list[tuple[int, bool]]:
    """(accepted count, bonus) of every verified round that carried candidates."""
    seen: list[tuple[int, bool]] = []
    ex = engine.executor
    submit, wait = ex.submit_target, ex.wait_target
    drafted: list[int] = []

    def submit_target(msg):
        drafted[:] = [len(s.tree_tokens) for s in msg.seqs]
        return submit(msg)

    def wait_target():
        out = wait()
        seen.extend((r.num_accepted, r.bonus) for n, r in zip(drafted, out.results, strict=True) if n)
        return out

    ex.submit_target, ex.wait_target = submit_target, wait_target
    return seen


def _run(target: str, speculative: dict | None, params: SamplingParams, prompts=PROMPTS):
    with LLM(target, speculative) as llm:
        seen = record_outcomes(llm.engine)
        return llm.generate(prompts, params), seen


def _check_against_references(target: str, prompt: list[int], out) -> None:
    assert len(out.logprobs) == len(out.token_ids)
    again = rescored(target, prompt, out.token_ids)
    ref = hf_logprobs(target, prompt + out.token_ids)[len(prompt) - 1:]  # [T, V]
    for j, (lp, rs) in enumerate(zip(out.logprobs, again, strict=True)):
        assert lp.token_id == out.token_ids[j] == rs.token_id
        assert lp.logprob == rs.logprob and lp.top == rs.top, f"token {j}: not the prefill's bits"
        assert abs(lp.logprob - ref[j, lp.token_id].item()) < 1e-4
        assert [i for i, _ in lp.top] == ref[j].topk(K).indices.tolist()
        assert all(abs(v - ref[j, i].item()) < 1e-4 for i, v in lp.top)


def test_greedy_logprobs_equal_the_targets_with_and_without_speculation(llama) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=K)
    plain, _ = _run(llama.target, None, params)
    sped, seen = _run(llama.target, spec(llama.perturbed, 3), params)
    assert any(n for n, _ in seen) and any(not b for _, b in seen) and any(b for _, b in seen)
    for p, a, b in zip(PROMPTS, plain, sped, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bitwise: the same rows, whatever the round shape
        _check_against_references(llama.target, p, b)


@pytest.mark.parametrize("branching", [None, [2, 2, 1]])
def test_sampled_logprobs_of_accepted_recovered_and_bonus_tokens(llama, branching) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, logprobs=K)
    outs, seen = _run(llama.target, spec(llama.perturbed, 3 if branching is None else None, branching), params)
    assert any(n for n, _ in seen), "no accepted token"
    assert any(not b for _, b in seen), "no recovered token"
    assert any(b for _, b in seen), "no bonus token"
    for p, o in zip(PROMPTS, outs, strict=True):
        _check_against_references(llama.target, p, o)


def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(llama) -> None:
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    with LLM(llama.target, None, max_num_batched_tokens=8, block_size=4) as llm:  # chunked prefill
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # caches the prompt's blocks
        out = llm.generate([prompt], params)[0]
        assert out.logprobs is None
    ref = hf_logprobs(llama.target, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert [i for i, _ in lp.top] == ref[pos - 1].topk(2).indices.tolist()


def test_processed_logprobs_are_the_transformed_law(llama) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.5, top_k=4, seed=3, ignore_eos=True, logprobs=6,
                            logprobs_mode="processed_logprobs")
    out = _run(llama.target, None, params, prompts=PROMPTS[:1])[0][0]
    ref = hf_logprobs(llama.target, PROMPTS[0] + out.token_ids)[len(PROMPTS[0]) - 1:]  # raw, [T, V]
    for j, lp in enumerate(out.logprobs):
        scaled = ref[j] / 0.5  # log_softmax / T has the softmax(logits / T) ranks and differences
        kth = scaled.topk(4).values[-1]
        law = torch.log_softmax(torch.where(scaled >= kth, scaled, torch.tensor(-math.inf)), dim=-1)
        assert abs(lp.logprob - law[lp.token_id].item()) < 1e-4
        assert [v for _, v in lp.top][4:] == [-math.inf, -math.inf]  # past top-k: cut from the law


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_limits_name_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be between 0 and {MAX_LOGPROBS}"):
        SamplingParams(**{field: MAX_LOGPROBS + 1})
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="processed_logits")


def test_generate_job_lines_carry_logprobs_when_asked(llama) -> None:
    import io
    import json

    from engine.jobs.generate import run_batch

    lines = [json.dumps({"id": "a", "prompt_token_ids": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                         "logprobs": 2, "prompt_logprobs": 1}),
             json.dumps({"id": "b", "prompt_token_ids": PROMPTS[0], "max_tokens": 4, "temperature": 0})]
    out = io.StringIO()
    with LLM(llama.target, None) as llm:
        run_batch(llm.engine, lines, out, {}, progress=False)
        whole = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
    a, b = (json.loads(s) for s in out.getvalue().splitlines())
    assert [e["token_id"] for e in a["logprobs"]] == a["token_ids"] == whole.token_ids
    assert [e["logprob"] for e in a["logprobs"]] == [e.logprob for e in whole.logprobs]
    assert all(len(e["top"]) == 2 for e in a["logprobs"])
    assert a["prompt_logprobs"][0] is None and [e["token_id"] for e in a["prompt_logprobs"][1:]] == PROMPTS[0][1:]
    assert "logprobs" not in b and "prompt_logprobs" not in b
