"""The per-layer native ops of the 4-bit path (workers/kernels/layer_glue.py): values against the torch ops they
replace, a row of an M-row call == that row alone (M = 1..17, 1 and 2 threads), shown to catch a deliberately
M-dependent variant, and a tiny Q4_1 model's logits and greedy tokens the same through the glued layers as
through the torch path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.helpers_gguf import hf_to_gguf
from tests.helpers_models import make_tiny_checkpoint
from workers.kernels import gguf_blocks, layer_glue
from workers.layers import RotaryEmbedding, apply_rotary, silu_and_mul

pytestmark = pytest.mark.skipif(not gguf_blocks.available(),
                                reason="the native GGUF kernel did not build here: models keep the torch path")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64  # SmolLM2-135M's shapes


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cos_sin(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 2048, (m,), generator=torch.Generator().manual_seed(9))
    return RotaryEmbedding(HEAD_DIM, 1e5, None)(positions)  # [M, 1, D] each


def row_dependence(op: Callable[[int, int], torch.Tensor], threads: int) -> list[int]:
    """The row counts M in 2..17 at which ``op(start, m)`` (rows start .. start + m of one 17-row input) differs
    from those rows computed one at a time."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([op(i, 1) for i in range(17)])
        return [m for m in range(2, 18) if any(not torch.equal(op(s, m), alone[s:s + m]) for s in {0, 17 - m})]
    finally:
        torch.set_num_threads(before)


def test_add_rms_norm_is_the_torch_sum_and_norm() -> None:
    for k in (HIDDEN, 100):  # 100: a tail shorter than the 16 lanes
        hidden, delta, w = _rand(17, k), _rand(17, k, seed=1), _rand(k, seed=2)
        total, normed = layer_glue.add_rms_norm(hidden, delta, w, 1e-5)
        ref_total, ref_normed = layer_glue.add_rms_norm_reference(hidden, delta, w, 1e-5)
        assert torch.equal(total, ref_total)  # the residual add: torch's bits
        torch.testing.assert_close(normed, ref_normed, rtol=1e-6, atol=1e-6)  # another summation order
        torch.testing.assert_close(layer_glue.add_rms_norm(hidden, None, w, 1e-5)[1],
                                   layer_glue.add_rms_norm_reference(hidden, None, w, 1e-5)[1], rtol=1e-6, atol=1e-6)


def test_rope_is_torch_bits_on_q_and_k_and_leaves_v() -> None:
    m, qk = 17, HEADS + KV_HEADS
    qkv = _rand(m, (qk + KV_HEADS) * HEAD_DIM)  # [M, (Hq + 2 Hkv) D]
    cos, sin = _cos_sin(m)
    ref = apply_rotary(qkv[:, :qk * HEAD_DIM].view(m, qk, HEAD_DIM), cos, sin).reshape(m, -1)
    out = layer_glue.rope_(qkv.clone(), cos, sin, qk, HEAD_DIM)
    assert torch.equal(out[:, :qk * HEAD_DIM], ref)
    assert torch.equal(out[:, qk * HEAD_DIM:], qkv[:, qk * HEAD_DIM:])


def test_silu_mul_matches_torch() -> None:
    x = _rand(17, 2 * 1536) * 4
    torch.testing.assert_close(layer_glue.silu_mul(x), silu_and_mul(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_an_m_row_call_equals_the_row_alone(threads: int) -> None:
    hidden, delta, w = _rand(17, HIDDEN), _rand(17, HIDDEN, seed=1), _rand(HIDDEN, seed=2)
    qkv, gu = _rand(17, 15 * HEAD_DIM, seed=3), _rand(17, 2 * 1536, seed=4)
    cos, sin = _cos_sin(17)
    ops = {
        "add_rms_norm": lambda s, m: torch.cat(layer_glue.add_rms_norm(hidden[s:s + m], delta[s:s + m], w, 1e-5), 1),
        "rope_": lambda s, m: layer_glue.rope_(qkv[s:s + m].clone(), cos[s:s + m], sin[s:s + m], 12, HEAD_DIM),
        "silu_mul": lambda s, m: layer_glue.silu_mul(gu[s:s + m]),
    }
    assert {name: row_dependence(op, threads) for name, op in ops.items()} == {name: [] for name in ops}


def test_an_m_dependent_norm_is_caught() -> None:
    """The check above fails on the test-only variant that sums the squares in reverse when M > 1."""
    hidden, w = _rand(17, HIDDEN) * 3, _rand(HIDDEN, seed=2)
    skewed = row_dependence(lambda s, m: layer_glue.add_rms_norm(hidden[s:s + m], None, w, 1e-5, "skewed")[1], 1)
    assert skewed == list(range(2, 18))


@pytest.fixture(scope="module", params=["q8", "f32"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """A tiny Q4_1 model on the native kernel, with 8-bit activations (where this CPU has them) or float32 ones."""
    from workers.loader import load_model
    from workers.quantized_linear import activations

    tmp = tmp_path_factory.mktemp("glue")
    hf = make_tiny_checkpoint(tmp / "hf", family="llama", vocab_size=128, seed=3, head_dim=16,
                              num_attention_heads=4, num_key_value_heads=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_GGUF_ACTIVATIONS", request.param)
        if activations() != request.param:
            pytest.skip(f"{request.param} activations do not run on this CPU")
        return load_model(hf_to_gguf(hf, tmp / "tiny-q4_1.gguf", "Q4_1"))


def _layer_ops(layer: torch.nn.Module, isa: str = "auto") -> dict[str, Callable[[int, int], torch.Tensor]]:
    g = layer_glue.GluedLayer(layer, isa)
    h = layer.input_layernorm.weight.shape[0]
    hidden, delta = _rand(17, h, seed=5), _rand(17, h, seed=6)
    attn = _rand(17, layer.self_attn.num_heads * layer.self_attn.head_dim, seed=7)
    cos, sin = (t for t in RotaryEmbedding(layer.self_attn.head_dim, 1e4, None)(torch.arange(40, 57)))
    return {
        "front": lambda s, m: torch.cat(g.front(hidden[s:s + m], delta[s:s + m], cos[s:s + m], sin[s:s + m]), 1),
        "back": lambda s, m: torch.cat(g.back(hidden[s:s + m], attn[s:s + m]), 1),
    }


@pytest.mark.parametrize("threads", [1, 2])
def test_glued_layer_rows_ignore_the_batch(tiny: torch.nn.Module, threads: int) -> None:
    layer = tiny.model.layers[0]
    ops = _layer_ops(layer)
    assert {name: row_dependence(op, threads) for name, op in ops.items()} == {"front": [], "back": []}
    if tiny.quant_report.activations == "f32":  # 8-bit activations round a norm's last-bit changes away
        assert row_dependence(_layer_ops(layer, "skewed")["front"], threads) != []  # the check can fail


def test_glued_layer_computes_the_torch_layer(tiny: torch.nn.Module) -> None:
    layer = tiny.model.layers[0]
    attn, g = layer.self_attn, layer_glue.GluedLayer(layer)
    h = layer.input_layernorm.weight.shape[0]
    hidden, delta, out = _rand(5, h, seed=5), _rand(5, h, seed=6), _rand(5, attn.num_heads * attn.head_dim, seed=7)
    cos, sin = RotaryEmbedding(attn.head_dim, 1e4, None)(torch.arange(3, 8))
    total, qkv = g.front(hidden, delta, cos, sin)
    qk = attn.num_heads + attn.num_kv_heads
    ref_qkv = attn.qkv_proj(layer.input_layernorm(hidden + delta))
    ref_qkv[:, :qk * attn.head_dim] = apply_rotary(ref_qkv[:, :qk * attn.head_dim].view(5, qk, -1), cos,
                                                   sin).reshape(5, -1)
    assert torch.equal(total, hidden + delta)
    torch.testing.assert_close(qkv, ref_qkv, rtol=1e-4, atol=1e-4)
    total2, mlp_out = g.back(total, out)
    ref_total2 = total + attn.o_proj(out)
    assert torch.equal(total2, ref_total2)
    torch.testing.assert_close(mlp_out, layer.mlp(layer.post_attention_layernorm(ref_total2)), rtol=1e-4, atol=1e-4)


def test_tiny_model_takes_the_glue_and_keeps_its_logits_and_greedy_tokens(tiny: torch.nn.Module) -> None:
    from workers.input_batch import SeqForward
    from workers.model_runner import ModelRunner

    cfg = tiny.config
    assert tiny.model.glue is not None  # the loader chose the glued layers for this model (native block weights)
    tokens, logits = {}, {}
    try:
        for glue in (False, True):
            assert tiny.model.set_glue(glue) == glue
            runner = ModelRunner(tiny, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 9, 16, cfg.dtype, "cpu")
            ids = [5, 17, 99, 3, 41, 8]
            rows = runner.forward([SeqForward(list(range(1, 9)), 0, list(range(-1, len(ids) - 1)), ids,
                                              logit_nodes=list(range(len(ids))))])  # [6, V]
            nxt = int(rows[-1].argmax())
            for _ in range(24):  # greedy decode
                ids.append(nxt)
                nxt = int(runner.forward([SeqForward(list(range(1, 9)), len(ids) - 1, [-1], [nxt],
                                                     logit_nodes=[0])])[0].argmax())
            tokens[glue], logits[glue] = ids, rows
    finally:
        tiny.model.set_glue()
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    assert tokens[True] == tokens[False]


def test_a_glued_forward_cut_in_pieces_equals_the_whole(tiny: torch.nn.Module) -> None:
    """Self-speculation runs the layers in two ranges and the final norm itself (workers/layer_skip/): with the
    glue, those pieces give the whole forward's bits."""
    from workers.attention import PagedContext
    from workers.input_batch import SeqForward, build_batch
    from workers.kv_cache import KVCache
    from workers.layer_skip.partial import run_layers

    cfg = tiny.config
    cache = KVCache(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    batch = build_batch([SeqForward(list(range(1, 9)), 0, list(range(-1, 6)), [5, 17, 99, 3, 41, 8, 2])], 16)

    def ctx() -> PagedContext:
        return PagedContext(batch.meta, cache, row_invariant=True)

    tiny.model.aux_layers = (1, -1)  # and the hidden states an EAGLE head reads: layer 1's input, the output
    try:
        whole = tiny(batch.input_ids, batch.positions, ctx())  # [7, H]
        aux = tiny.model.aux_hidden  # [7, 2 H]
    finally:
        tiny.model.aux_layers, tiny.model.aux_hidden = (), None
    lower = run_layers(tiny, batch.input_ids, batch.positions, ctx(), 0, 1)
    pieces = tiny.model.norm(run_layers(tiny, batch.input_ids, batch.positions, ctx(), 1, cfg.num_layers, lower))
    assert torch.equal(pieces, whole)
    assert torch.equal(aux, torch.cat([lower, whole], -1))
