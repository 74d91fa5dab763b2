"""One forward pass over many sequences, each extending its committed prefix with a small scratch tree.

Every kind of forward is the same thing seen this way:

- prefill (a chunk of the prompt): the chunk is a chain of scratch nodes, all committed afterwards;
- decode without speculation: one scratch node (the in-flight token);
- target verification: the in-flight token(s) followed by the candidate tree, one pass;
- draft proposal: the draft's in-flight tokens (all it has not cached), then the tree one depth at a time
  (earlier depths of this round are already in the scratch pad; ``new_start`` says where this call's nodes
  begin).

Scratch node ``j`` of a sequence lives at the slot of position ``base_len + j`` in its block table, its RoPE
position is ``base_len + depth(j)``, and it attends to the committed prefix plus its own ancestors and itself.
The scheduler reserves the scratch blocks; ``commit`` later moves the accepted nodes down to
``base_len, base_len + 1, ...``.

``build_batch`` runs once per forward for every model call, so it is written for speed: plain-list work is
O(tokens + blocks) (the ancestor walk only for real trees), and the attention layout takes the cheapest form
that is exact: no mask for a single query or a fresh prompt, a view instead of a gather for one sequence with
contiguous blocks, no query padding when every sequence feeds the same number of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from workers.attention import PagedMetadata, RowKeyLayout
from workers.tree_topology import is_chain, node_depths

__all__ = ["SeqForward", "ancestor_masks", "build_batch", "commit_moves", "is_chain", "node_depths"]


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
    # (start, stop) when logit_rows is the contiguous range start..stop-1: a slice, no gather, selects them.
    logit_range: tuple[int, int] | None = None


def _slot(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of positions [start, end): one range per block touched."""
    out: list[int] = []
    pos = start
    while pos < end:
        blk, off = divmod(pos, block_size)
        stop = min(end, (blk + 1) * block_size)
        first = block_table[blk] * block_size + off
        out.extend(range(first, first + stop - pos))
        pos = stop
    return out


def _contiguous(blocks: list[int]) -> bool:
    return blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def build_batch(seqs: list[SeqForward], block_size: int, device: str | torch.device = "cpu") -> BuiltBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    logit_rows: list[int] = []
    # Per sequence with new tokens (the attention batch):
    n_new: list[int] = []
    n_keys: list[int] = []
    tables: list[list[int]] = []  # blocks covering the keys
    limits: list[list[int]] = []  # per query: keys [0, limit) visible before the tree's own ancestor rule
    chains: list[bool] = []
    trees: list[tuple[int, int, SeqForward]] = []  # (seq in attention batch, first key of its scratch, piece)
    # The native op's layout (``RowKeyLayout``): 4 ints a row, and the block tables and extra positions they index.
    row_fields: list[int] = []
    key_index: list[int] = []
    for s in seqs:
        n_scratch = len(s.parents)
        needed = s.base_len + n_scratch
        if needed > len(s.block_table) * block_size:
            raise ValueError(f"block table covers {len(s.block_table) * block_size} slots, {needed} needed")
        first = s.base_len + s.new_start  # slot position of this call's first node
        new = n_scratch - s.new_start
        if s.logit_nodes:
            if not s.new_start <= min(s.logit_nodes) <= max(s.logit_nodes) < n_scratch:
                bad = [j for j in s.logit_nodes if not s.new_start <= j < n_scratch]
                raise ValueError(f"logit node {bad[0]} is not among this call's nodes [{s.new_start}, {n_scratch})")
            shift = len(input_ids) - s.new_start
            logit_rows += [j + shift for j in s.logit_nodes]
        if new == 0:
            continue
        chain = is_chain(s.parents)
        input_ids += s.token_ids
        slot_mapping += _slots(s.block_table, first, needed, block_size)
        table = s.block_table[: -(-needed // block_size)]
        table_at = len(key_index)
        key_index += table
        if chain:
            positions += range(first, needed)
            limits.append(list(range(first + 1, needed + 1)))
            for p in range(first + 1, needed + 1):
                row_fields += (table_at, p, 0, 0)
        else:
            depths = node_depths(s.parents)
            positions += [s.base_len + depths[j] for j in range(s.new_start, n_scratch)]
            limits.append([s.base_len] * new)  # the committed prefix; the scratch part comes from the tree
            trees.append((len(n_new), s.base_len, s))
            for j in range(s.new_start, n_scratch):
                path = _path(s.parents, j)
                row_fields += (table_at, s.base_len, len(key_index), len(path))
                key_index += (s.base_len + a for a in path)
        chains.append(chain)
        n_new.append(new)
        n_keys.append(needed)
        tables.append(table)

    slots = torch.tensor(slot_mapping, dtype=torch.long, device=device)
    groups = attention_groups(n_new, n_keys, GROUP_CALL_PAIRS if torch.device(device).type == "cpu"
                              else GROUP_CALL_PAIRS_GPU)
    if len(groups) <= 1:
        meta = _layout(slots, n_new, n_keys, tables, limits, chains, trees, block_size, device)
    else:
        meta = PagedMetadata(slot_mapping=slots, num_seqs=len(n_new), num_queries=max(n_new), num_keys=max(n_keys))
        starts = [0]
        for n in n_new:
            starts.append(starts[-1] + n)
        for group in groups:
            at = {i: g for g, i in enumerate(group)}
            rows = [r for i in group for r in range(starts[i], starts[i] + n_new[i])]
            meta.groups.append(_layout(None, [n_new[i] for i in group], [n_keys[i] for i in group],
                                       [tables[i] for i in group], [limits[i] for i in group],
                                       [chains[i] for i in group],
                                       [(at[i], base, s) for i, base, s in trees if i in at], block_size, device))
            meta.group_rows.append(torch.tensor(rows, dtype=torch.long, device=device))

    if torch.device(device).type == "cpu":  # the native op runs on CPUs only
        meta.row_keys = RowKeyLayout(torch.tensor(row_fields, dtype=torch.long).view(-1, 4),
                                     torch.tensor(key_index, dtype=torch.long), block_size)
    logit_range = None
    if logit_rows and logit_rows[-1] - logit_rows[0] == len(logit_rows) - 1 and \
            logit_rows == list(range(logit_rows[0], logit_rows[-1] + 1)):
        logit_range = (logit_rows[0], logit_rows[-1] + 1)
    return BuiltBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        logit_range=logit_range,
    )


def _path(parents: list[int], j: int) -> list[int]:
    """Scratch node j's ancestors and itself, root first (a parent always precedes its children)."""
    path = [j]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


SPLIT_QUERIES = 16  # sequences feeding more new tokens than this (prompt chunks) attend apart from the others
# What attending apart costs (another gather and SDPA call per layer), in padded query-key pairs: sequences of
# different query counts attend together unless apart they compute this many fewer pairs.
GROUP_CALL_PAIRS = 2048
# On a GPU padded pairs are cheap and a call is not (a kernel launch per layer); not measured yet (no GPU lent):
# ~0.1 ms of SDPA per 2.5e5 pairs at ~10 TFLOP/s with 16 x 32-dim heads, against ~20-40 us per extra call.
GROUP_CALL_PAIRS_GPU = 1 << 18


def attention_groups(n_new: list[int], n_keys: list[int], call_pairs: int = GROUP_CALL_PAIRS
                     ) -> list[list[int]]:
    """The attention batch's sequences (by index) split into groups that attend apart, each padded to its own
    longest query and key count.

    One layout pads every sequence's queries to the longest: a prompt chunk beside decode rounds made, at batch
    32, one 249-token chunk and 31 single-token rounds an attention of 32 x 249 queries (1.2 s a step instead of
    ~0.3 s), so prompt chunks (over ``SPLIT_QUERIES``) attend apart. Decode rounds of different depths pad alike:
    at batch 32 (built-in target, ~300-token contexts) one depth-8 round beside 31 of depth 4 made the verify
    ~20 % dearer than 32 rounds of depth 4, about what 32 of depth 5 cost. So the rounds are grouped by query
    count too, adjacent counts merged where apart they would save fewer than ``call_pairs`` padded pairs
    (the fewest total padded pairs plus that per group, over the partitions of the sorted counts)."""
    long = [i for i, n in enumerate(n_new) if n > SPLIT_QUERIES]
    short = [i for i, n in enumerate(n_new) if n <= SPLIT_QUERIES]
    counts = sorted({n_new[i] for i in short})
    members: dict[int, list[int]] = {q: [] for q in counts}
    for i in short:
        members[n_new[i]].append(i)
    keys = {q: max(n_keys[i] for i in members[q]) for q in counts}
    # best[j]: the cheapest split of counts[:j]; cut[j]: where its last group starts.
    best, cut = [0.0] + [math.inf] * len(counts), [0] * (len(counts) + 1)
    for j in range(1, len(counts) + 1):
        seqs, top_keys = 0, 0
        for i in range(j - 1, -1, -1):  # the last group: counts[i:j]
            seqs += len(members[counts[i]])
            top_keys = max(top_keys, keys[counts[i]])
            cost = best[i] + seqs * counts[j - 1] * top_keys + call_pairs
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = len(counts)
    while j > 0:
        groups.append(sorted(i for q in counts[cut[j]:j] for i in members[q]))
        j = cut[j]
    return ([long] if long else []) + groups[::-1]


def _layout(slots: torch.Tensor | None, n_new: list[int], n_keys: list[int], tables: list[list[int]],
            limits: list[list[int]], chains: list[bool], trees: list[tuple[int, int, SeqForward]], block_size: int,
            device: str | torch.device) -> PagedMetadata:
    """The attention layout of these sequences (their new tokens laid end to end in this order)."""
    b = len(n_new)
    nq = max(n_new, default=0)
    nk = max(n_keys, default=0)
    meta = PagedMetadata(slot_mapping=slots, num_seqs=b, num_queries=nq, num_keys=nk)
    if b == 1 and _contiguous(tables[0]):
        meta.kv_start = tables[0][0] * block_size
    elif b:
        nb = max(len(t) for t in tables)
        meta.kv_blocks = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long, device=device)
    if any(n != nq for n in n_new):
        query_index: list[int] = []
        out_index: list[int] = []
        row = 0
        for i, n in enumerate(n_new):
            query_index += range(row, row + n)
            query_index += [0] * (nq - n)
            out_index += range(i * nq, i * nq + n)
            row += n
        meta.query_index = torch.tensor(query_index, dtype=torch.long, device=device)
        meta.out_index = torch.tensor(out_index, dtype=torch.long, device=device)

    all_chains = all(chains)
    if b == 1 and all_chains and n_new[0] == n_keys[0]:
        meta.causal = True  # a fresh prompt: queries and keys coincide
    elif not (all_chains and nq == 1 and all(n == nk for n in n_keys)):
        # Padding queries see key 0 only, so softmax never sees an empty row.
        lim = [row + [1] * (nq - len(row)) for row in limits]
        mask = torch.arange(nk, device=device) < torch.tensor(lim, dtype=torch.long, device=device).unsqueeze(-1)
        # Requests mostly share one tree shape: one indexed write per shape puts its ancestor pattern at every
        # such request's scratch keys.
        shapes: dict[tuple[int, tuple[int, ...]], tuple[list[int], list[int]]] = {}
        for i, base, s in trees:
            seqs_and_bases = shapes.setdefault((s.new_start, tuple(s.parents)), ([], []))
            seqs_and_bases[0].append(i)
            seqs_and_bases[1].append(base)
        for (new_start, parents), (rows, bases) in shapes.items():
            pattern = torch.tensor(ancestor_masks(list(parents))[new_start:], dtype=torch.bool,
                                   device=device)  # [new, scratch]
            n_q, n_s = pattern.shape
            b_idx = torch.tensor(rows, dtype=torch.long, device=device).view(-1, 1, 1)
            k_idx = torch.tensor(bases, dtype=torch.long, device=device).view(-1, 1, 1) + torch.arange(
                n_s, device=device)  # [G, 1, scratch]
            mask[b_idx, torch.arange(n_q, device=device).view(1, -1, 1), k_idx] = pattern
        meta.mask = mask.unsqueeze(1)  # [B, 1, Q, L]

    return meta


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
