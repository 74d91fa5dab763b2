"""Compressed attention state of DeepSeek-V4, per sequence and layer, and how a forward pass extends it.

Committed state of one sequence (``SeqState``), per layer (``LayerState``):
- ``ring``      [W, D]   raw K=V of the last W positions; position t lives in slot t % W;
- per compressor (the CSA/HCA compressor, and the CSA indexer's own one), ``CompressorState``:
  ``acc_kv`` / ``acc_gate`` [A, C] fp32: the projected rows of the last A positions (row t % A), where
  A = m for HCA (non-overlapping windows) and 2m for CSA (a summary pools its window and the previous one);
  ``summaries`` [n, D]: one row per completed window, append-only, paged (``PagedRows``);
- the position (tokens committed), shared by all layers.

Appending the token at position t writes ring slot t % W and accumulator row t % A, and completes summary
t // m when (t + 1) % m == 0. Summary i is visible to query t only when i < (t + 1) // m.

A forward pass feeds a *tree* of new nodes per sequence (a chain for prefill and decode, one node for serial
decode): each node's parent is an earlier node or -1 (the committed prefix). Nothing of the committed state is
written during the pass. Each node computes only its own rows -- its ring row, its accumulator rows, and the
summary of the window it completes, if any -- into ``LayerScratch``; a node reads the committed state plus its
ancestors' rows, never a sibling's (``TreePlan`` holds the masks and gather indices that say which rows).
``commit(path)`` then installs the accepted path's rows; the rest of the scratch is dropped. So a branch
"copies" exactly the rows it changes, and prefill in chunks, serial decode and tree verify run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.models.deepseek_v4_config import CSA, HCA, DeepseekV4ModelConfig

SUMMARY_BLOCK = 16  # rows per page of a summary list


def ring_slots(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Ring slot of each position (a function so a test can inject the 'slot not advanced' fault)."""
    return positions % window


def summaries_visible(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many summaries a query at each position may see: those whose window is complete."""
    return (positions + 1) // ratio


class PagedRows:
    """Append-only rows [n, dim] stored in fixed-size pages: appending never moves what is there."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self.pages: list[torch.Tensor] = []  # each [SUMMARY_BLOCK, dim]
        self.count = 0
        self._view: torch.Tensor | None = None

    def append(self, rows: torch.Tensor) -> None:
        """rows: [k, dim]."""
        for row in rows:
            if self.count == len(self.pages) * SUMMARY_BLOCK:
                self.pages.append(torch.zeros(SUMMARY_BLOCK, self.dim, dtype=self.dtype, device=self.device))
            self.pages[-1][self.count % SUMMARY_BLOCK] = row
            self.count += 1
        self._view = None

    def rows(self) -> torch.Tensor:
        """[count, dim]: the pages laid end to end (one copy, cached until the next append)."""
        if self._view is None:
            if not self.pages:
                self._view = torch.zeros(0, self.dim, dtype=self.dtype, device=self.device)
            else:
                self._view = torch.cat(self.pages)[: self.count]
        return self._view

    def truncate(self, count: int) -> None:
        """Forget the rows from ``count`` on (an undone commit's summaries)."""
        if count < self.count:
            self.count = count
            self._view = None

    def clone(self) -> PagedRows:
        other = PagedRows(self.dim, self.dtype, self.device)
        other.pages = [p.clone() for p in self.pages]
        other.count = self.count
        return other


@dataclass
class CompressorState:
    acc_kv: torch.Tensor  # [A, C] fp32
    acc_gate: torch.Tensor  # [A, C] fp32
    summaries: PagedRows  # [n, D]

    def clone(self) -> CompressorState:
        return CompressorState(self.acc_kv.clone(), self.acc_gate.clone(), self.summaries.clone())


@dataclass
class LayerState:
    kind: str  # SLIDING, CSA or HCA
    ring: torch.Tensor  # [W, D]
    comp: CompressorState | None = None  # CSA / HCA compressor
    index: CompressorState | None = None  # CSA indexer's compressor

    def clone(self) -> LayerState:
        return LayerState(self.kind, self.ring.clone(), self.comp.clone() if self.comp else None,
                          self.index.clone() if self.index else None)

    def nbytes(self) -> int:
        total = self.ring.nbytes
        for c in (self.comp, self.index):
            if c is not None:
                total += c.acc_kv.nbytes + c.acc_gate.nbytes + sum(p.nbytes for p in c.summaries.pages)
        return total


@dataclass
class SeqState:
    position: int
    layers: list[LayerState]

    @staticmethod
    def empty(config: DeepseekV4ModelConfig, device: torch.device | str = "cpu") -> SeqState:
        device = torch.device(device)
        d, w = config.head_dim, config.sliding_window

        def compressor(ratio: int, dim: int, overlap: bool) -> CompressorState:
            rows, cols = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
            # fp32 accumulators (float64 in float64 reference runs)
            z = torch.zeros(rows, cols, dtype=torch.promote_types(config.dtype, torch.float32), device=device)
            return CompressorState(z, z.clone(), PagedRows(dim, config.dtype, device))

        layers = []
        for kind in config.layer_kinds:
            state = LayerState(kind, torch.zeros(w, d, dtype=config.dtype, device=device))
            if kind == CSA:
                state.comp = compressor(config.csa_ratio, d, True)
                state.index = compressor(config.csa_ratio, config.index_head_dim, True)
            elif kind == HCA:
                state.comp = compressor(config.hca_ratio, d, False)
            layers.append(state)
        return SeqState(0, layers)

    def clone(self) -> SeqState:
        return SeqState(self.position, [s.clone() for s in self.layers])

    def nbytes(self) -> int:
        """Bytes of the whole state (what copying it per branch would cost)."""
        return sum(s.nbytes() for s in self.layers)


@dataclass
class WindowPlan:
    """The summaries one forward completes for one compressor ratio (layer-independent)."""

    ratio: int
    overlap: bool  # CSA: a summary pools 2m rows (previous window's first half-channels + its own)
    nodes: torch.Tensor  # [S] long: the node completing each new summary, in node order
    index: torch.Tensor  # [S] long: that summary's index in the sequence
    # Source row of each pooled position: < A: committed accumulator row; A + j: new node j; -1: padding
    # (positions before the sequence start; zero kv, gate -inf).
    gather: torch.Tensor  # [S, L] long, L = A = 2m (overlap) or m
    committed: int  # summaries already committed (all visible to every node of this forward)
    visible_committed: torch.Tensor  # [N, committed] bool
    visible_new: torch.Tensor  # [N, S] bool


@dataclass
class TreePlan:
    """Everything about one sequence's new nodes that does not depend on the layer."""

    position: int  # committed tokens before this forward
    parents: list[int]
    positions: torch.Tensor  # [N] long
    ancestors: torch.Tensor  # [N, N] bool: column j is an ancestor of row i, or i itself
    ring_visible: torch.Tensor  # [N, W] bool: committed ring slot readable by the node
    new_visible: torch.Tensor  # [N, N] bool: new node's K=V readable by the node (ancestor, inside the window)
    windows: dict[str, WindowPlan] = field(default_factory=dict)  # by layer kind (CSA, HCA)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must come before their children (-1: the prefix)")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def make_plan(config: DeepseekV4ModelConfig, position: int, parents: list[int],
              device: torch.device | str = "cpu") -> TreePlan:
    # Plain-list work (a handful of nodes per sequence, thousands of sequences a step), one tensor each at the end.
    n, w = len(parents), config.sliding_window
    depths = _depths(parents)
    pos = [position + d for d in depths]
    paths: list[list[int]] = []  # paths[i][d]: the ancestor of node i at depth d (itself at its own depth)
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    anc = [[False] * n for _ in range(n)]
    for i, path in enumerate(paths):
        for j in path:
            anc[i][j] = True
    slot_pos = [(position - 1) - ((position - 1 - s) % w) for s in range(w)]  # position held by each slot
    ring_visible = [[0 <= q and q > pi - w for q in slot_pos] for pi in pos]
    new_visible = [[anc[i][j] and pos[j] > pos[i] - w for j in range(n)] for i in range(n)]

    def t(x, dtype=torch.bool) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    plan = TreePlan(position, list(parents), t(pos, torch.long), t(anc).view(n, n), t(ring_visible).view(n, w),
                    t(new_visible).view(n, n))
    for kind, ratio in ((CSA, config.csa_ratio), (HCA, config.hca_ratio)):
        if kind not in config.layer_kinds:
            continue
        overlap = kind == CSA
        span = 2 * ratio if overlap else ratio  # pooled rows per summary = accumulator rows
        completing = [i for i in range(n) if (pos[i] + 1) % ratio == 0]
        gather = []
        for node in completing:
            row = []
            for r in range(span):
                q = pos[node] - span + 1 + r
                row.append(-1 if q < 0 else q % span if q < position else span + paths[node][q - position])
            gather.append(row)
        index = [(pos[c] + 1) // ratio - 1 for c in completing]
        committed = position // ratio
        seen = summaries_visible(torch.tensor(pos), ratio).tolist()
        vis_c = [[j < seen[i] for j in range(committed)] for i in range(n)]
        # a new summary: same branch (ancestor or descendant, never a sibling) and its window complete
        vis_n = [[(anc[i][c] or anc[c][i]) and index[k] < seen[i] for k, c in enumerate(completing)]
                 for i in range(n)]
        plan.windows[kind] = WindowPlan(ratio, overlap, t(completing, torch.long), t(index, torch.long),
                                        t(gather, torch.long).view(len(completing), span), committed,
                                        t(vis_c).view(n, committed), t(vis_n).view(n, len(completing)))
    return plan


@dataclass
class CompressorScratch:
    kv: torch.Tensor  # [N, C] fp32: each new node's projected row
    gate: torch.Tensor  # [N, C] fp32
    summaries: torch.Tensor  # [S, D]: the summaries completed by new nodes (WindowPlan.nodes order)


@dataclass
class LayerScratch:
    kv: torch.Tensor  # [N, D]: each new node's ring row
    comp: CompressorScratch | None = None
    index: CompressorScratch | None = None


def scratch_nbytes(scratch: list[LayerScratch]) -> int:
    total = 0
    for s in scratch:
        total += s.kv.nbytes
        for c in (s.comp, s.index):
            if c is not None:
                total += c.kv.nbytes + c.gate.nbytes + c.summaries.nbytes
    return total


def commit(state: SeqState, plan: TreePlan, scratch: list[LayerScratch], path: list[int]) -> None:
    """Install the rows of the accepted ``path`` (node indices, depth 0 first, each the parent of the next)."""
    if not path:
        return
    for a, b in zip(path, path[1:], strict=False):
        if plan.parents[b] != a:
            raise ValueError(f"commit path {path} is not a chain of parent -> child nodes")
    if plan.parents[path[0]] != -1:
        raise ValueError(f"commit path must start at a depth-0 node, got node {path[0]}")
    device = plan.positions.device
    nodes = torch.tensor(path, dtype=torch.long, device=device)
    positions = plan.positions.index_select(0, nodes)  # [P]
    for st, sc in zip(state.layers, scratch, strict=True):
        st.ring.index_copy_(0, ring_slots(positions, st.ring.shape[0]), sc.kv.index_select(0, nodes))
        for cs, csc in ((st.comp, sc.comp), (st.index, sc.index)):
            if cs is None or csc is None:
                continue
            rows = positions % cs.acc_kv.shape[0]
            cs.acc_kv.index_copy_(0, rows, csc.kv.index_select(0, nodes))
            cs.acc_gate.index_copy_(0, rows, csc.gate.index_select(0, nodes))
            wp = plan.windows[st.kind]
            on_path = torch.isin(wp.nodes, nodes)  # completing nodes on the path, in depth order
            if bool(on_path.any()):
                cs.summaries.append(csc.summaries[on_path])
    state.position += len(path)


@dataclass
class Undo:
    """What a commit overwrites, saved before it runs, so it can be taken back (a pipelined draft rolls back
    tokens it had committed on a prediction). Only the rows the commit writes are saved."""

    position: int
    ring: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (slots [P], their old rows [P, D])
    acc: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]  # per layer, compressor: rows, kv, gate
    summaries: list[list[int]]  # per layer, compressor: summary count before


def save_undo(state: SeqState, plan: TreePlan, path: list[int]) -> Undo:
    nodes = torch.tensor(path, dtype=torch.long, device=plan.positions.device)
    positions = plan.positions.index_select(0, nodes)
    undo = Undo(state.position, [], [], [])
    for st in state.layers:
        slots = ring_slots(positions, st.ring.shape[0])
        undo.ring.append((slots, st.ring.index_select(0, slots)))
        accs, counts = [], []
        for c in (st.comp, st.index):
            if c is not None:
                rows = positions % c.acc_kv.shape[0]
                accs.append((rows, c.acc_kv.index_select(0, rows), c.acc_gate.index_select(0, rows)))
                counts.append(c.summaries.count)
        undo.acc.append(accs)
        undo.summaries.append(counts)
    return undo


def apply_undo(state: SeqState, undo: Undo) -> None:
    """Restore the state as it was before the commit ``undo`` was saved for (a slot written twice by that
    commit saved the same old row twice, so restoring in any order is right)."""
    for st, (slots, old), accs, counts in zip(state.layers, undo.ring, undo.acc, undo.summaries, strict=True):
        st.ring.index_copy_(0, slots, old)
        comps = [c for c in (st.comp, st.index) if c is not None]
        for c, (rows, kv, gate), n in zip(comps, accs, counts, strict=True):
            c.acc_kv.index_copy_(0, rows, kv)
            c.acc_gate.index_copy_(0, rows, gate)
            c.summaries.truncate(n)
    state.position = undo.position
