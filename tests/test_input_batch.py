"""Scratch-tree forward batches: what each node sees, where it sits, where its KV goes, and how commit moves it.

Visibility is checked through the attention itself, whatever form the batch builder gives the mask (explicit,
causal, none): with all-zero queries every visible key gets the same weight, and the value stored at slot s is
the one-hot vector e_s, so each output row is exactly uniform over the slots its query attended to.
"""

from __future__ import annotations

import pytest
import torch

from workers import input_batch
from workers.attention import PagedContext
from workers.input_batch import SeqForward, ancestor_masks, build_batch, commit_moves, node_depths
from workers.kv_cache import KVCache

BS = 4
NUM_BLOCKS = 24
NUM_SLOTS = BS * NUM_BLOCKS
TREE_221 = [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]  # branching [2, 2, 1]: 2 + 4 + 4 nodes


def slot(table: list[int], pos: int) -> int:
    return table[pos // BS] * BS + pos % BS


def ancestors_and_self(parents: list[int], j: int) -> set[int]:
    out = set()
    while j >= 0:
        out.add(j)
        j = parents[j]
    return out


def test_depths_and_ancestor_masks_of_a_tree() -> None:
    assert node_depths(TREE_221) == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    masks = ancestor_masks(TREE_221)
    for j in range(len(TREE_221)):
        assert {i for i, m in enumerate(masks[j]) if m} == ancestors_and_self(TREE_221, j)
    assert not masks[1][0] and not masks[0][1]  # siblings at the root
    assert not masks[3][2] and not masks[7][6] and not masks[8][2]  # siblings and cousins
    assert node_depths([]) == [] and ancestor_masks([]) == []
    with pytest.raises(ValueError, match="topologically ordered"):
        node_depths([-1, 2, 0])


def probe_visibility(seqs: list[SeqForward]) -> tuple[list[set[int]], object]:
    """Run one attention layer over the batch; returns, per new token in batch order, the slots it attended to."""
    batch = build_batch(seqs, BS)
    cache = KVCache(1, NUM_BLOCKS, BS, 1, NUM_SLOTS)
    cache.kv[1, 0, :, 0] = torch.eye(NUM_SLOTS)  # the value at slot s is e_s (committed prefix included)
    t = batch.input_ids.shape[0]
    q = torch.zeros(t, 1, NUM_SLOTS)
    k = torch.randn(t, 1, NUM_SLOTS)  # irrelevant: q = 0 scores every key 0
    v = torch.eye(NUM_SLOTS)[batch.meta.slot_mapping].unsqueeze(1)  # new tokens carry their own slot's e_s
    out = PagedContext(batch.meta, cache).attend(0, q, k, v)[:, 0]  # [T, NUM_SLOTS]
    seen = []
    for row in out:
        nz = set((row > 1e-6).nonzero().flatten().tolist())
        assert nz and torch.allclose(row[sorted(nz)], torch.full((len(nz),), 1.0 / len(nz))), "not uniform"
        seen.append(nz)
    return seen, batch


def _mixed_batch() -> tuple[list[SeqForward], list[list[int]]]:
    """A prefill chunk, a verification (1 in-flight token + a tree), a draft expansion call, a decode step."""
    t0 = [5, 9, 2]  # non-contiguous blocks on purpose
    t1 = [11, 3, 4, 20]
    t2 = [7, 8, 1, 0]
    t3 = [6, 12]
    verify_parents = [-1] + [0 if p < 0 else 1 + p for p in TREE_221]  # in-flight token, then the tree under it
    draft_parents = [-1, 0, 0, 1, 1, 2, 2]  # two chain tokens, a 2-wide level, then this call's 4 nodes
    seqs = [
        SeqForward(t0, base_len=3, parents=list(range(-1, 5)), token_ids=[10, 11, 12, 13, 14, 15],
                   logit_nodes=[5]),
        SeqForward(t1, base_len=5, parents=verify_parents, token_ids=list(range(30, 41)),
                   logit_nodes=list(range(11))),
        SeqForward(t2, base_len=6, parents=draft_parents, token_ids=[50, 51, 52, 53], new_start=3,
                   logit_nodes=[3, 4, 5, 6]),
        SeqForward(t3, base_len=7, parents=[-1], token_ids=[60], logit_nodes=[0]),
    ]
    return seqs, [t0, t1, t2, t3]


def test_nodes_see_prefix_ancestors_and_themselves_only() -> None:
    seqs, tables = _mixed_batch()
    seen, batch = probe_visibility(seqs)
    row = 0
    for s, table in zip(seqs, tables, strict=True):
        depths = node_depths(s.parents)
        for j in range(s.new_start, len(s.parents)):
            want = {slot(table, p) for p in range(s.base_len)}
            want |= {slot(table, s.base_len + a) for a in ancestors_and_self(s.parents, j)}
            assert seen[row] == want, f"seq with base {s.base_len}, node {j}"
            # RoPE position: prefix length + depth; KV written at the node's own scratch slot.
            assert batch.positions[row].item() == s.base_len + depths[j]
            assert batch.meta.slot_mapping[row].item() == slot(table, s.base_len + j)
            row += 1
    assert row == batch.input_ids.shape[0]
    assert batch.input_ids.tolist() == [t for s in seqs for t in s.token_ids]


def _chunk_beside_rounds() -> list[SeqForward]:
    """A 20-token prompt chunk (longer than SPLIT_QUERIES), a tree verification and a decode step."""
    tree = [-1] + [0 if p < 0 else 1 + p for p in TREE_221]
    return [SeqForward([13, 14, 15, 16, 17, 18, 19], 2, list(range(-1, 19)), list(range(20)), logit_nodes=[19]),
            SeqForward([4, 5, 6, 7], 2, tree, list(range(11))),
            SeqForward([2, 3], 5, [-1], [1])]


@pytest.mark.parametrize("case", ["fresh-prompt", "decode-equal-lengths", "single-tree", "chunk-beside-rounds"])
def test_visibility_in_special_layouts(case: str) -> None:
    """Layouts a fast builder may special-case (no mask, a causal flag, a cache view, a chunk attending apart from
    the rounds) see the same keys."""
    if case == "chunk-beside-rounds":
        seqs = _chunk_beside_rounds()
        assert len(build_batch(seqs, BS).meta.groups) == 2
    elif case == "fresh-prompt":
        seqs = [SeqForward(list(range(3)), 0, list(range(-1, 9)), list(range(10)), logit_nodes=[9])]
    elif case == "decode-equal-lengths":
        seqs = [SeqForward([2, 3], 5, [-1], [1]), SeqForward([9, 4], 5, [-1], [2])]
    else:
        seqs = [SeqForward([4, 5, 6, 7], 2, [-1] + [0 if p < 0 else 1 + p for p in TREE_221], list(range(11)))]
    seen, _ = probe_visibility(seqs)
    row = 0
    for s in seqs:
        for j in range(s.new_start, len(s.parents)):
            want = {slot(s.block_table, p) for p in range(s.base_len)}
            want |= {slot(s.block_table, s.base_len + a) for a in ancestors_and_self(s.parents, j)}
            assert seen[row] == want
            row += 1


def test_logit_rows_follow_the_requested_nodes_in_order() -> None:
    seqs, _ = _mixed_batch()
    batch = build_batch(seqs, BS)
    # Rows: seq0 has 6 new tokens (0-5), seq1 11 (6-16), seq2 4 (17-20: its nodes 3..6), seq3 1 (21).
    assert batch.logit_rows.tolist() == [5] + list(range(6, 17)) + [17, 18, 19, 20] + [21]


def test_build_batch_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="block table covers 8 slots, 9 needed"):
        build_batch([SeqForward([0, 1], 6, [-1, 0, 1], [1, 2, 3])], BS)
    with pytest.raises(ValueError, match="logit node"):
        build_batch([SeqForward([0, 1], 0, [-1, 0, 1], [2, 3], new_start=1, logit_nodes=[0])], BS)
    with pytest.raises(ValueError, match="token_ids has 2 entries, expected 3"):
        SeqForward([0], 0, [-1, 0, 1], [1, 2])


def test_commit_moves_put_the_accepted_path_at_the_next_positions() -> None:
    table = [3, 7, 1]
    # A chain accepted from its start is already in place.
    assert commit_moves(table, 5, [0, 1, 2], BS) == ([], [])
    # In-flight token (node 0) stays; tree nodes 2 and 4 (scratch 3 and 5 here) move to positions 6 and 7.
    src, dst = commit_moves(table, 5, [0, 3, 5], BS)
    assert src == [slot(table, 8), slot(table, 10)] and dst == [slot(table, 6), slot(table, 7)]
    assert commit_moves(table, 2, [], BS) == ([], [])


def test_commit_copies_the_path_kv_across_blocks_in_every_layer() -> None:
    table = [4, 2, 9]
    cache = KVCache(2, 12, BS, 1, 3)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    before = cache.kv.clone()
    base, path = 3, [1, 2, 4, 5]  # position base + d <- scratch node path[d] (position base + path[d])
    src, dst = commit_moves(table, base, path, BS)
    cache.move(torch.tensor(src), torch.tensor(dst))
    for d, j in enumerate(path):
        torch.testing.assert_close(cache.kv[:, :, slot(table, base + d)], before[:, :, slot(table, base + j)],
                                   rtol=0, atol=0)
    for p in range(base):  # the committed prefix is untouched
        torch.testing.assert_close(cache.kv[:, :, slot(table, p)], before[:, :, slot(table, p)], rtol=0, atol=0)


def _rounds_of_mixed_depths() -> list[SeqForward]:
    """Verify rounds of chains 1, 4 and 8 deep (2, 5, 9 queries) and a tree, over contexts of different lengths:
    one layout would pad every sequence to 11 queries."""
    tree = [-1] + [0 if p < 0 else 1 + p for p in TREE_221]
    chain = lambda n: [-1] + list(range(n - 1))  # noqa: E731
    return [SeqForward([0, 1, 2, 3], 7, chain(9), list(range(9))),
            SeqForward([4, 5], 3, chain(2), [1, 2]),
            SeqForward([6, 7, 8, 9, 10], 9, tree, list(range(11))),
            SeqForward([11, 12, 13], 1, chain(5), list(range(5))),
            SeqForward([14, 15], 5, chain(2), [3, 4])]


def test_rounds_of_different_depths_attend_apart_where_padding_costs_more_than_a_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped by query count: together where the padding saved is worth less than ``GROUP_CALL_PAIRS``."""
    assert input_batch.attention_groups([1] * 30 + [9, 9], [400] * 32) == [list(range(30)), [30, 31]]
    assert input_batch.attention_groups([20, 5, 1, 5], [30, 1000, 1000, 1000]) == [[0], [2], [1, 3]]
    assert input_batch.attention_groups([4, 5, 4, 5], [8, 8, 8, 8]) == [[0, 1, 2, 3]]  # 8 pairs saved: one call
    assert input_batch.attention_groups([5] * 8, [300] * 8) == [list(range(8))]
    # on a GPU a call costs more than that padding
    assert input_batch.attention_groups([1] * 30 + [9, 9], [400] * 32, input_batch.GROUP_CALL_PAIRS_GPU) == [
        list(range(32))]
    assert len(build_batch(_rounds_of_mixed_depths(), BS).meta.groups) == 0  # tiny contexts: one call pays
    monkeypatch.setattr(input_batch, "GROUP_CALL_PAIRS", 0)
    assert len(build_batch(_rounds_of_mixed_depths(), BS).meta.groups) == 4  # 2, 5, 9 and 11 queries


@pytest.mark.parametrize("seqs", [_chunk_beside_rounds, _rounds_of_mixed_depths])
@pytest.mark.parametrize("row_invariant", [False, True])
def test_a_chunk_attending_apart_gives_the_one_call_output(row_invariant: bool, seqs,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped attention (prompt chunk apart from the rounds; rounds of different depths apart) equals the
    single padded call, on the batched and on the row-by-row path."""
    seqs = seqs()
    monkeypatch.setattr(input_batch, "GROUP_CALL_PAIRS", 0)  # every query count apart
    batch = build_batch(seqs, BS)
    monkeypatch.setattr(input_batch, "SPLIT_QUERIES", 10**9)  # the reference: one layout for all
    monkeypatch.setattr(input_batch, "GROUP_CALL_PAIRS", 10**12)
    one_call = build_batch(seqs, BS)
    t = batch.input_ids.shape[0]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, 2, 8, generator=gen) for _ in range(3))
    outs = []
    for meta in (batch.meta, one_call.meta):
        cache = KVCache(1, NUM_BLOCKS, BS, 2, 8)
        cache.kv.normal_(generator=gen.manual_seed(1))
        outs.append(PagedContext(meta, cache, row_invariant=row_invariant).attend(0, q, k, v))  # [T, 2, 8]
    assert len(batch.meta.groups) >= 2 and not one_call.meta.groups
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
