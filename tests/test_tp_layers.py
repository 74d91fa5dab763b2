"""Tensor-parallel layers: shard slicing by hand, then whole models over Gloo match tp size 1."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers_models import make_tiny_checkpoint
from workers.attention import DenseCausalContext, PagedContext
from workers.distributed import TPGroup
from workers.input_batch import SeqForward, build_batch
from workers.kv_cache import KVCache
from workers.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workers.loader import load_model
from workers.model_config import ModelConfig


def ranks(size: int) -> list[TPGroup]:
    # Constructing and loading layers needs no process group; only forward passes communicate.
    return [TPGroup(r, size, None) for r in range(size)]


def test_column_and_row_shards_reassemble_the_full_matrix() -> None:
    w = torch.randn(8, 6)
    cols = [ColumnParallelLinear(6, 8, bias=False, tp=g) for g in ranks(2)]
    rows = [RowParallelLinear(8, 6, bias=True, tp=g) for g in ranks(2)]
    wr, b = torch.randn(6, 8), torch.randn(6)
    for c, r in zip(cols, rows, strict=True):
        c.weight_loader(c.weight, w)
        r.weight_loader(r.weight, wr)
        r.weight_loader(r.bias, b)
    torch.testing.assert_close(torch.cat([c.weight for c in cols], 0), w, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([r.weight for r in rows], 1), wr, atol=0, rtol=0)
    x = torch.randn(3, 8)
    partial = sum(torch.nn.functional.linear(x[:, 4 * i:4 * i + 4], r.weight) for i, r in enumerate(rows))
    torch.testing.assert_close(partial + b, x @ wr.T + b)


def test_merged_gate_up_keeps_each_ranks_slice_of_both_parts() -> None:
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for g in ranks(2):
        layer = MergedColumnParallelLinear(4, [8, 8], bias=False, tp=g)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        half = slice(4 * g.rank, 4 * g.rank + 4)
        torch.testing.assert_close(layer.weight, torch.cat([gate[half], up[half]]), atol=0, rtol=0)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_heads_split_and_kv_heads_replicated(tp_size: int) -> None:
    d, hq, hkv = 3, 4, 2
    q, k, v = torch.randn(hq * d, 5), torch.randn(hkv * d, 5), torch.randn(hkv * d, 5)
    for g in ranks(tp_size):
        layer = QKVParallelLinear(5, d, hq, hkv, bias=False, tp=g)
        for name, src in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, src, name)
        wq, wk, wv = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        q_heads = list(range(g.rank * hq // tp_size, (g.rank + 1) * hq // tp_size))
        # The kv heads on this rank are those its query heads are grouped with (GQA group = h // (hq/hkv)).
        kv_heads = sorted({h // (hq // hkv) for h in q_heads})
        assert layer.num_kv_heads == len(kv_heads)
        rows = lambda heads: [h * d + i for h in heads for i in range(d)]  # noqa: E731
        torch.testing.assert_close(wq, q[rows(q_heads)], atol=0, rtol=0)
        torch.testing.assert_close(wk, k[rows(kv_heads)], atol=0, rtol=0)
        torch.testing.assert_close(wv, v[rows(kv_heads)], atol=0, rtol=0)


def test_vocab_shards_pad_the_last_rank() -> None:
    table = torch.randn(10, 4)
    layers = [VocabParallelEmbedding(10, 4, tp=g) for g in ranks(4)]  # 3 rows each, last rank owns 1
    for layer in layers:
        layer.weight_loader(layer.weight, table)
    assert [layer.num_owned for layer in layers] == [3, 3, 3, 1]
    torch.testing.assert_close(torch.cat([layer.weight for layer in layers])[:10], table, atol=0, rtol=0)
    assert layers[-1].weight[1:].abs().sum() == 0


def test_bad_tp_sizes_are_refused_with_the_reason() -> None:
    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=16, hidden_size=24,
                      num_layers=1, num_heads=6, num_kv_heads=3, head_dim=4, intermediate_size=48,
                      rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=False)
    with pytest.raises(ValueError, match="num_heads=6"):
        cfg.check_tp(4)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        cfg.check_tp(2)
    assert cfg.num_kv_heads_per_rank(3) == 1 and cfg.num_kv_heads_per_rank(6) == 1


def test_size_one_layers_do_plain_math() -> None:
    emb = VocabParallelEmbedding(10, 4)
    head = ParallelLMHead(10, 4)
    table = torch.randn(10, 4)
    emb.weight_loader(emb.weight, table)
    head.weight_loader(head.weight, table)
    ids = torch.tensor([0, 9, 3])
    torch.testing.assert_close(emb(ids), table[ids], atol=0, rtol=0)
    h = torch.randn(2, 4)
    torch.testing.assert_close(head.logits(h), h @ table.T)


# ---- whole models over Gloo ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_logits(model) -> dict[str, torch.Tensor]:
    """Logits of a flattened two-sequence prefill and of a paged prefill + decode step."""
    cfg = model.config
    seqs = [[5, 17, 3, 99, 42, 8, 1], [120, 7, 7, 60]]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        out["dense"] = model.compute_logits(model(ids, pos, DenseCausalContext([len(s) for s in seqs])))
        cache = KVCache(cfg.num_layers, 4, 4, cfg.num_kv_heads_per_rank(model.tp.size), cfg.head_dim)
        for step, (base, toks) in enumerate([(0, seqs[0][:5]), (5, seqs[0][5:6])]):
            b = build_batch([SeqForward([2, 0], base, list(range(-1, len(toks) - 1)), toks,
                                        logit_nodes=[len(toks) - 1])], 4)
            hidden = model(b.input_ids, b.positions, PagedContext(b.meta, cache))
            out[f"paged{step}"] = model.compute_logits(hidden[b.logit_rows])
    return out


def _tp_worker(rank: int, size: int, port: int, ckpt: str, config: ModelConfig, out_dir: str,
               quantization: str | None = None) -> None:
    torch.set_num_threads(1)  # several ranks share the test machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        # The config read by the parent spares each rank importing transformers (seconds per process).
        model = load_model(ckpt, tp=TPGroup.from_process_group(), config=config, quantization=quantization)
        torch.save(run_logits(model), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family,tp_size,overrides", [
    ("llama", 2, {}),
    # 4 ranks over 2 kv heads (replicated), vocab 130 not divisible by 4, tied head, q/k norms
    ("qwen3", 4, {"tie_word_embeddings": True}),
])
def test_tensor_parallel_logits_equal_single_rank(tmp_path, family: str, tp_size: int, overrides: dict) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family=family, vocab_size=130, seed=7, **overrides)
    expected = run_logits(load_model(ckpt))
    args = (tp_size, free_port(), ckpt, ModelConfig.from_pretrained(ckpt), str(tmp_path))
    # fork: the ranks inherit the imported torch instead of paying seconds each to import it again.
    procs = mp.start_processes(_tp_worker, args=args, nprocs=tp_size, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not procs.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("tensor-parallel ranks did not finish within 120 s")
    for rank in range(tp_size):  # every rank returns the full, identical logits
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, ref in expected.items():
            assert got[key].shape == ref.shape
            torch.testing.assert_close(got[key], ref, atol=1e-5, rtol=0, msg=f"rank {rank}, {key}")
