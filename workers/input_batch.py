"""One forward pass over many sequences, each extending its committed prefix with a small scratch tree.

Every kind of forward is the same thing seen this way:

- prefill (a chunk of the prompt): the chunk is a chain of scratch nodes, all committed afterwards;
- decode without speculation: one scratch node (the pending token);
- target verification: the pending token followed by the candidate tree, one pass;
- draft proposal: the draft's uncached tokens, then the tree one depth at a time (earlier depths of this
  round are already in the scratch pad; ``new_start`` says where this call's nodes begin).

Scratch node ``j`` of a sequence lives at the slot of position ``base_len + j`` in its block table, its RoPE
position is ``base_len + depth(j)``, and it attends to the committed prefix plus its own ancestors and itself.
The scheduler reserves the scratch blocks; ``commit`` later moves the accepted nodes down to
``base_len, base_len + 1, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.attention import PagedMetadata


@dataclass
class SeqForward:
    """One sequence's part of a forward pass (plain ints: it crosses process boundaries)."""

    block_table: list[int]
    base_len: int  # tokens whose KV is committed in this cache: positions [0, base_len)
    parents: list[int]  # parent of every scratch node so far, incl. this call's; -1 = the committed prefix
    token_ids: list[int]  # the new nodes' tokens: scratch nodes [new_start, len(parents))
    new_start: int = 0
    logit_nodes: list[int] = field(default_factory=list)  # scratch node indices whose logits are wanted

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents) - self.new_start:
            raise ValueError(f"token_ids has {len(self.token_ids)} entries, expected "
                             f"{len(self.parents) - self.new_start} (nodes {self.new_start}..{len(self.parents)})")


def node_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for j, p in enumerate(parents):
        if p >= j:
            raise ValueError(f"parents must be topologically ordered: node {j} has parent {p}")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestor_masks(parents: list[int]) -> list[list[bool]]:
    """masks[j][i] is True when scratch node i is node j itself or one of its ancestors."""
    masks: list[list[bool]] = []
    n = len(parents)
    for j, p in enumerate(parents):
        row = list(masks[p]) if p >= 0 else [False] * n
        row[j] = True
        masks.append(row)
    return masks


@dataclass
class BuiltBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: PagedMetadata
    logit_rows: torch.Tensor  # [R] long: rows of the flattened batch whose logits are returned, in order


def _slot(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def build_batch(seqs: list[SeqForward], block_size: int, device: str | torch.device = "cpu") -> BuiltBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logit_rows: list[int] = []
    per_seq_rows: list[list[int]] = []
    per_seq_slots: list[list[int]] = []
    per_seq_mask: list[list[list[bool]]] = []
    for s in seqs:
        n_scratch = len(s.parents)
        needed = s.base_len + n_scratch
        if needed > len(s.block_table) * block_size:
            raise ValueError(f"block table covers {len(s.block_table) * block_size} slots, {needed} needed")
        depths = node_depths(s.parents)
        anc = ancestor_masks(s.parents)
        kv_slots = [_slot(s.block_table, pos, block_size) for pos in range(needed)]
        rows: list[int] = []
        mask_rows: list[list[bool]] = []
        for j in range(s.new_start, n_scratch):
            row = len(input_ids)
            rows.append(row)
            input_ids.append(s.token_ids[j - s.new_start])
            positions.append(s.base_len + depths[j])
            slot_mapping.append(kv_slots[s.base_len + j])
            mask_rows.append([True] * s.base_len + anc[j])
        base_row = rows[0] if rows else 0
        for j in s.logit_nodes:
            if not s.new_start <= j < n_scratch:
                raise ValueError(f"logit node {j} is not among this call's nodes [{s.new_start}, {n_scratch})")
            logit_rows.append(base_row + j - s.new_start)
        per_seq_rows.append(rows)
        per_seq_slots.append(kv_slots)
        per_seq_mask.append(mask_rows)

    b = len(seqs)
    q = max((len(r) for r in per_seq_rows), default=0)
    kv_len = max((len(s) for s in per_seq_slots), default=0)
    kv_slots_t = torch.zeros(b, kv_len, dtype=torch.long)
    mask_t = torch.zeros(b, 1, q, kv_len, dtype=torch.bool)
    mask_t[:, :, :, 0] = True  # padding queries attend one key, so softmax never sees an empty row
    query_index = torch.zeros(b, q, dtype=torch.long)
    query_valid = torch.zeros(b, q, dtype=torch.bool)
    for i in range(b):
        nk = len(per_seq_slots[i])
        kv_slots_t[i, :nk] = torch.tensor(per_seq_slots[i], dtype=torch.long)
        nq = len(per_seq_rows[i])
        if nq:
            m = torch.tensor(per_seq_mask[i], dtype=torch.bool)  # [nq, nk]
            mask_t[i, 0, :nq, :nk] = m
            mask_t[i, 0, :nq, nk:] = False
            query_index[i, :nq] = torch.tensor(per_seq_rows[i], dtype=torch.long)
            query_valid[i, :nq] = True
    meta = PagedMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        kv_slots=kv_slots_t.to(device),
        mask=mask_t.to(device),
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
    )
    return BuiltBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
    )


def commit_moves(block_table: list[int], base_len: int, path: list[int], block_size: int) -> tuple[list[int],
                                                                                                   list[int]]:
    """Slots to copy so that scratch nodes ``path`` (root to leaf) become positions base_len, base_len+1, ...

    Nodes already in place (path[d] == d: a chain accepted from its start) need no copy.
    """
    src: list[int] = []
    dst: list[int] = []
    for d, j in enumerate(path):
        if j != d:
            src.append(_slot(block_table, base_len + j, block_size))
            dst.append(_slot(block_table, base_len + d, block_size))
    return src, dst
