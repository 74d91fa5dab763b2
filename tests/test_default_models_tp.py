"""The built-in target splits 2, 4 and 8 ways: widened exactly (training/widen_heads.py), greedy output kept.

The target was trained with 10 query / 5 KV heads and widened to 16 / 8 by appending heads whose q/k/v rows
and o_proj input columns are zero. These tests check the widening on a random model (logits unchanged),
the shipped weights' padding, and the real weights' logits split over 2, 4, 8 forked Gloo ranks. The engine's
greedy output with speculation at TP 8 (Ray actors, Gloo) against TP 1 without speculation is checked on the
same weights by tests/test_ray_placement.py (one TP 8 engine for placement and output).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from engine.core.config import DEFAULT_MODELS_DIR
from tests.test_tp_layers import free_port, run_logits
from training.widen_heads import widen_checkpoint
from workers.loader import load_model
from workers.model_config import ModelConfig

TARGET = DEFAULT_MODELS_DIR / "target"
DRAFT = DEFAULT_MODELS_DIR / "draft"
TRAINED_HEADS, TRAINED_KV_HEADS = 10, 5  # what the weights were trained with; the rest is padding
MAX_TOKENS = 12


def test_shipped_target_splits_2_4_8_ways() -> None:
    cfg = ModelConfig.from_pretrained(str(TARGET))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 8, 32)
    assert {1, 2, 4, 8} <= set(cfg.valid_tp_sizes(8))
    assert cfg.vocab_size % 8 == 0 and cfg.intermediate_size % 8 == 0  # no padded vocab or FFN shard


def test_shipped_padding_heads_are_zero_and_contribute_nothing() -> None:
    state = load_file(str(TARGET / "model.safetensors"))
    d = 32
    layers = {k.split(".")[2] for k in state if ".layers." in k}
    assert len(layers) == 8
    for i in layers:
        p = f"model.layers.{i}.self_attn."
        assert state[p + "o_proj.weight"][:, TRAINED_HEADS * d:].abs().max() == 0
        assert state[p + "q_proj.weight"][TRAINED_HEADS * d:].abs().max() == 0
        for kv in ("k_proj.weight", "v_proj.weight"):
            assert state[p + kv][TRAINED_KV_HEADS * d:].abs().max() == 0
        # The trained heads are real weights (the padding is not hiding a broken checkpoint).
        assert state[p + "o_proj.weight"][:, : TRAINED_HEADS * d].abs().min(dim=0).values.gt(0).any()


def test_widening_keeps_the_logits(tmp_path) -> None:
    """A random GQA Llama (6 query / 3 KV heads, head_dim != hidden / heads after widening) widened to 8 / 4:
    same logits, finite everywhere, and the widening refuses to change the GQA group size."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=3, intermediate_size=64, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    info = widen_checkpoint(tmp_path / "src", tmp_path / "wide", heads=8, kv_heads=4)
    # per layer: 2 new query heads (q rows + o columns), 1 new KV head (k + v rows), head_dim 8, hidden 48
    assert info["params_new"] - info["params_old"] == 2 * (2 * 2 * 8 * 48 + 2 * 1 * 8 * 48)
    old = AutoModelForCausalLM.from_pretrained(str(tmp_path / "src"), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(tmp_path / "wide"), dtype=torch.float32).eval()
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["head_dim"] == 8
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        a, b = old(input_ids=ids).logits, new(input_ids=ids).logits  # [2, 40, 64]
    assert torch.isfinite(b).all()
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="query heads per KV head"):
        widen_checkpoint(tmp_path / "src", tmp_path / "bad", heads=8, kv_heads=8)


def _fp32_rank(rank: int, size: int, port: int, config: ModelConfig, out_dir: str) -> None:
    """One forked rank: the shipped fp16 weights in float32 (as the engine runs them on CPU), its shard only."""
    import torch.distributed as dist

    from workers.distributed import TPGroup

    torch.set_num_threads(1)  # several ranks share the test machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        model = load_model(str(TARGET), dtype=torch.float32, tp=TPGroup.from_process_group(), config=config)
        torch.save(run_logits(model), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_shipped_target_logits_over_gloo_ranks_equal_one_rank(tmp_path, tp_size: int) -> None:
    """The real weights split 2/4/8 ways (forked ranks over Gloo): prefill and paged decode logits equal one
    rank's up to float32 summation order, with the same argmax. At 8 ranks, ranks 5-7 hold only padding."""
    import torch.multiprocessing as mp

    expected = run_logits(load_model(str(TARGET), dtype=torch.float32))
    args = (tp_size, free_port(), ModelConfig.from_pretrained(str(TARGET)), str(tmp_path))
    procs = mp.start_processes(_fp32_rank, args=args, nprocs=tp_size, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not procs.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("tensor-parallel ranks did not finish within 120 s")
    for rank in range(tp_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, ref in expected.items():
            torch.testing.assert_close(got[key], ref, atol=1e-4, rtol=0, msg=f"rank {rank}, {key}")
            assert torch.equal(got[key].argmax(-1), ref.argmax(-1))
