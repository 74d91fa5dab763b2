"""The native row attention (workers/kernels/row_attention.cpp via ``native_attention``): every query row of a
forward in one call, each (row, head) in one fixed order over exactly its visible keys, read from the paged cache
by slot. Values against float64 attention; a row of an M-row call == that row alone, bit for bit, for M = 1..17
at 1 and 2 threads, with decode rows of several sequences, chain rows and tree rows in the layouts
``build_batch`` makes (shuffled block tables); shown to catch a variant whose exp-sum order depends on M."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_row_invariance import _AttentionOnly, _invariance_failures
from workers.attention import PagedContext
from workers.input_batch import SeqForward, build_batch
from workers.kernels import gguf_blocks, row_attention
from workers.kernels.row_attention import dense_layout, native_attention, native_isas, reference_attention
from workers.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not gguf_blocks.available(),
                                reason="the kernel library did not build here: float32 rows take the SDPA path")

BLOCK = 4
HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's heads


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 2, 8), (4, 2, 16), (4, 4, 40), (8, 2, 128), (2, 1, 160)])
def test_values_match_float64_attention(hq: int, hkv: int, d: int) -> None:
    """Every head shape the paths take (D a multiple of 16 or not, GQA or not, past the vector path's 128)."""
    g = torch.Generator().manual_seed(d)
    counts = [1, 2, 15, 16, 17, 33, 100, 513, 7]
    k, v = (torch.randn(520, hkv, d, generator=g) for _ in range(2))  # [slots, Hkv, D]
    q = torch.randn(len(counts), hq, d, generator=g) * 2  # sharper softmaxes than unit scores
    rows, index = dense_layout(counts, 16, 520)
    want = reference_attention(q, k, v, counts, d ** -0.5)
    for isa in native_isas():
        got = native_attention(q, k, v, rows, index, 16, d ** -0.5, isa)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5, msg=f"{isa}")


def _cache_and_rows(seed: int = 0) -> tuple[KVCache, list[tuple[SeqForward, SeqForward]]]:
    """A one-layer cache of random K/V and candidate rows, each as (the piece that holds it inside a bigger call,
    the same row alone): decode rows of 5 sequences, a chain of 6 (its rows alone: decode steps at each
    position) and a tree 0 -> {1, 2}, 1 -> {3, 4}, 3 -> 5 (a node alone: its depth's call, as a draft proposes)."""
    g = torch.Generator().manual_seed(seed)
    nseq, per = 7, 40
    cache = KVCache(1, nseq * per + 1, BLOCK, HKV, D)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g) * 3)
    perm = (torch.randperm(nseq * per, generator=g) + 1).tolist()  # scattered blocks, as a long-running pool's
    tables = [perm[i * per:(i + 1) * per] for i in range(nseq)]
    cands = []
    for i, base in enumerate((3, 17, 31, 64, 100)):
        row = SeqForward(tables[i], base, [-1], [1])
        cands.append((row, row))
    base = 45
    for j in range(6):
        cands.append((SeqForward(tables[5], base, list(range(-1, 5)), [1] * 6), SeqForward(tables[5], base + j, [-1],
                                                                                           [1])))
    parents = [-1, 0, 0, 1, 1, 3]
    for j in range(6):
        cands.append((SeqForward(tables[6], 77, parents, [1] * 6),
                      SeqForward(tables[6], 77, parents[:j + 1], [1], new_start=j)))
    return cache, cands


# The candidates as pieces of a forward: (first candidate, rows); decode rows between the chain and the tree.
PIECES = [(0, 1), (5, 6), (1, 1), (11, 6), (2, 1), (3, 1), (4, 1)]


def _rows_differing(isa: str, threads: int) -> list[str]:
    """For every M in 1..17, in two arrangements (the pieces in PIECES' order and reversed): one call over M rows
    (the pieces in turn, the last one cut: a chain's first nodes, a tree's first nodes), each row against its lone
    call."""
    cache, cands = _cache_and_rows()
    q_all = torch.randn(len(cands), HQ, D, generator=torch.Generator().manual_seed(1)) * 2
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    differ = []
    try:
        alone = []
        for i, (_, single) in enumerate(cands):
            rk = build_batch([single], BLOCK).meta.row_keys
            alone.append(native_attention(q_all[i:i + 1], cache.k[0], cache.v[0], rk.rows, rk.index, BLOCK, 0.125,
                                          isa))
        for arrangement in (PIECES, PIECES[::-1]):
            for m in range(1, 18):
                pieces, ids = [], []
                for first, size in arrangement:
                    take = min(size, m - len(ids))
                    if take <= 0:
                        break
                    p = cands[first][0]
                    pieces.append(SeqForward(p.block_table, p.base_len, p.parents[:take], [1] * take))
                    ids += range(first, first + take)
                rk = build_batch(pieces, BLOCK).meta.row_keys
                got = native_attention(q_all[ids], cache.k[0], cache.v[0], rk.rows, rk.index, BLOCK, 0.125, isa)
                differ += [f"row {r} in {m} rows at {threads} threads" for t, r in enumerate(ids)
                           if not torch.equal(got[t:t + 1], alone[r])]
    finally:
        torch.set_num_threads(saved)
    return differ


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_an_m_row_call_equals_the_row_alone(threads: int) -> None:
    for isa in native_isas():
        assert _rows_differing(isa, threads) == []


def test_a_variant_summing_in_an_m_dependent_order_fails_that_check() -> None:
    """The test-only "skewed" variant sums exp(s - max) in one running sum when the call has more than one row
    (the lanes' order otherwise): the check above must see it."""
    assert _rows_differing("skewed", 1) != []


def test_the_paths_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(4)
    counts = list(range(1, 40)) + [511, 512, 513]
    for d in (8, 40, 64, 128):
        k, v = (torch.randn(520, HKV, d, generator=g) * 4 for _ in range(2))
        q = torch.randn(len(counts), HQ, d, generator=g) * 4
        rows, index = dense_layout(counts, 16, 520)
        outs = [native_attention(q, k, v, rows, index, 16, d ** -0.5, isa) for isa in native_isas()]
        assert all(torch.equal(o, outs[0]) for o in outs)


def test_forward_rows_match_masked_sdpa() -> None:
    """The layout ``build_batch`` makes loses no row and mixes none up: a paged forward of decode rows, a chain
    and a tree (one native call) is close to the SDPA path over the same cache."""
    cache, cands = _cache_and_rows()
    pieces = [cands[0][0], cands[3][0], cands[5][0], cands[11][0]]  # two decode rows, the chain, the tree
    batch = build_batch(pieces, BLOCK)
    t = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(t, HQ, D, generator=g), torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D,
                                                                                                   generator=g)
    native = PagedContext(batch.meta, cache, 0.125, row_invariant=True).attend(0, q, k, v)
    plain = PagedContext(batch.meta, cache, 0.125, row_invariant=False).attend(0, q, k, v)
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", ["1", "0"])
def test_attention_rows_ignore_the_batch_either_path(native: str, monkeypatch) -> None:
    """Both row-invariant paths (the native op; one SDPA call per row, ``SPECSERVE_ROW_ATTENTION=0``) pass the
    model-level checks (decode rows in batches, a chain and a tree against decode steps)."""
    monkeypatch.setenv("SPECSERVE_ROW_ATTENTION", native)
    assert _invariance_failures(_AttentionOnly(row_invariant=True)) == []


def test_without_the_library_rows_take_sdpa_and_it_is_said_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(gguf_blocks, "available", lambda: False)
    row_attention._unavailable.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=row_attention.__name__):
            assert not row_attention.native_here() and not row_attention.native_here()
            assert _invariance_failures(_AttentionOnly(row_invariant=True)) == []
        assert sum("native row attention unavailable" in r.getMessage() for r in caplog.records) == 1
    finally:
        row_attention._unavailable.cache_clear()
