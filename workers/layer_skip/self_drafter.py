"""The target worker's self-drafter: a tree (or chain) of drafts from layers 0..L-1 + the exit, then a verify that
starts at layer L.

The design is in workers/layer_skip/__init__.py. ``draft`` runs the early passes and keeps, per sequence, a pad:
the rows' layer-L hidden states, their tokens, scratch parents and base length. ``forward`` is the target's verify
forward with the pads used: pieces whose rows (and tree) equal a pad's run layers L..N-1 from it; every other piece
(prompt chunks, a round drafted elsewhere, a pad that does not match) runs the whole model as before. Pads live for
one round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.attention import PagedContext
from workers.distributed import TPGroup
from workers.input_batch import SeqForward, build_batch
from workers.law_channel import DraftLaws
from workers.layer_skip.exit import ExitHead
from workers.layer_skip.messages import SelfDraftOutput, SelfDraftSeq, SelfDraftStep
from workers.layer_skip.partial import num_layers, run_layers
from workers.messages import DraftTree
from workers.model_runner import ModelRunner
from workers.proposal import ProposalMode, draw_children
from workers.sampling import logits_to_probs
from workers.streams import stream
from workers.tree_topology import most_probable_path
from workers.worker_base import sampling_batch


@dataclass
class _Pad:
    base_len: int
    tokens: list[int]  # in-flight then drafted tokens whose layers < L have run, in scratch order
    parents: list[int]  # their scratch parents (workers/tree_topology.py ``scratch_parents``)
    hidden: list[torch.Tensor]  # per row: [H], the input of layer L


@dataclass
class _Tree:
    """One sequence's round: the tree grown a depth per pass, its laws, and the nodes the next pass runs."""

    seq: SelfDraftSeq
    pad: _Pad
    branching: list[int]  # children per node at each depth (a chain: all 1)
    generator: torch.Generator | None  # the tree's draws, seeded by (request seed, prefix length)
    new: list[int] = field(default_factory=list)  # scratch nodes the next pass runs (the in-flight tokens first)
    depth: int = 0  # the depth of the children the next pass's exit draws
    laws: list[torch.Tensor] = field(default_factory=list)  # per drafted node: [V], the law it was drawn from

    @property
    def expands(self) -> bool:
        return self.depth < len(self.branching)

    def piece(self) -> SeqForward:
        """This pass's rows; the exit reads the last in-flight token first, then every node of the last depth."""
        wanted = ([len(self.seq.token_ids) - 1] if self.depth == 0 else list(self.new)) if self.expands else []
        return SeqForward(self.seq.block_table, self.seq.base_len, list(self.pad.parents),
                          [self.pad.tokens[i] for i in self.new], new_start=self.new[0], logit_nodes=wanted)

    def grow(self, parent: int, tokens: list[int], laws: list[torch.Tensor] | None) -> None:
        """``parent``'s children (a scratch node), appended in drawn order: the next pass runs them."""
        for tok in tokens:
            self.pad.tokens.append(tok)
            self.pad.parents.append(parent)
            self.new.append(len(self.pad.tokens) - 1)
        if laws is not None:
            self.laws += laws


class SelfDrafter:
    def __init__(self, runner: ModelRunner, exit_layer: int, exit_head: ExitHead, seed_salt: int,
                 law_sink: Callable[[list[DraftLaws]], None] | None, tp: TPGroup | None = None,
                 tree_sampling: str = ProposalMode.IID.value) -> None:
        n = num_layers(runner.model)
        if not 1 <= exit_layer <= n - 1:
            raise ValueError(f"exit_layer must be in 1 .. {n - 1} (the target has {n} layers), got {exit_layer}")
        self.runner = runner
        self.exit_layer = exit_layer
        self.exit = exit_head
        self.seed_salt = seed_salt  # the draft's streams: never the verifier's (TARGET_SALT)
        self.law_sink = law_sink  # the verifying rank's law store (None on the other tensor-parallel ranks)
        self.tp = tp or TPGroup.single()
        self.mode = ProposalMode(tree_sampling)  # how siblings are drawn at temperature > 0 (workers/proposal.py)
        self._pads: dict[int, _Pad] = {}
        self._next_tree_id = 0

    @torch.inference_mode()
    def draft(self, msg: SelfDraftStep) -> SelfDraftOutput:
        """A tree per sequence, one depth per pass: pass 0 runs the in-flight tokens' early layers and the exit
        on the last of them (the root's children), pass d the depth d - 1 nodes' (their children), and a last
        pass the deepest nodes' early layers only, so that every drafted row's layers < L are in the cache."""
        start = time.perf_counter()
        self._pads = {}
        trees = [self._tree(s) for s in msg.seqs if s.num_tokens > 0]
        live = [t for t in trees if t.seq.token_ids]
        marks = [start]
        while live:
            pieces = [t.piece() for t in live]
            hidden, rows = self._early(pieces)
            at = 0
            expanding: list[tuple[_Tree, int]] = []  # (tree, parent scratch node) per exit row, in row order
            for t, piece in zip(live, pieces, strict=True):
                t.pad.hidden += list(hidden[at: at + len(t.new)])
                at += len(t.new)
                expanding += [(t, node) for node in piece.logit_nodes]
                t.new = []
            for (t, node), (tokens, laws) in zip(expanding, self._draw(expanding, self.exit(rows)), strict=True):
                t.grow(node, tokens, laws)
            for t in live:
                t.depth += 1
            live = [t for t in live if t.new]  # the deepest nodes' early layers run once more, without the exit
            marks.append(time.perf_counter())
        done = {t.seq.seq_id: self._finish(t) for t in trees}
        empty = DraftTree([], [], -1, 0, [])
        passes = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        forward_s = passes[:-2] + [sum(passes[-2:])] if len(passes) > 1 else passes
        return SelfDraftOutput([done.get(s.seq_id, empty) for s in msg.seqs], time.perf_counter() - start,
                               forward_s)

    def _tree(self, s: SelfDraftSeq) -> _Tree:
        u = len(s.token_ids)
        gen = stream(s.sampling, self.seed_salt, s.base_len + u, self.runner.device)
        return _Tree(s, _Pad(s.base_len, list(s.token_ids), list(range(-1, u - 1)), []),
                     list(s.branching) or [1] * s.num_tokens, gen, new=list(range(u)))

    def _early(self, pieces: list[SeqForward]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0..L-1 over the pieces' new rows: (their layer-L hidden states [T, H], the logit rows' [R, H])."""
        model = self.runner.model
        batch = build_batch(pieces, self.runner.block_size, self.runner.device)
        ctx = PagedContext(batch.meta, self.runner.cache, row_invariant=getattr(model, "row_invariant", False))
        hidden = run_layers(model, batch.input_ids, batch.positions, ctx, 0, self.exit_layer)  # [T, H]
        return hidden, hidden.index_select(0, batch.logit_rows)

    def _draw(self, rows: list[tuple[_Tree, int]], logits: torch.Tensor
              ) -> list[tuple[list[int], list[torch.Tensor] | None]]:
        """Each exit row's children from its logits [R, V]: the top tokens for greedy requests (verified by argmax
        matching, no law), else drawn from the transformed softmax (workers/proposal.py), each child's law kept."""
        widths = [t.branching[t.depth] for t, _ in rows]
        out: list[list[int]] = [[] for _ in rows]
        laws: list[list[torch.Tensor] | None] = [None] * len(rows)
        for i, (t, _) in enumerate(rows):
            if t.seq.sampling.greedy:  # a stable sort: ties go to the lowest id, as argmax's first maximum
                out[i] = ([int(logits[i].argmax())] if widths[i] == 1 else
                          logits[i].sort(descending=True, stable=True).indices[: widths[i]].tolist())
        drawing = [i for i, (t, _) in enumerate(rows) if not t.seq.sampling.greedy]
        if drawing:
            specs = [rows[i][0].seq.sampling for i in drawing]
            probs = logits_to_probs(logits[drawing], sampling_batch(specs, [1] * len(specs), logits.device))  # [S, V]
            for i, q in zip(drawing, probs, strict=True):
                toks, child_laws = draw_children(q, widths[i], self.mode, rows[i][0].generator)
                out[i] = toks.tolist()
                # i.i.d. siblings share one law object: it crosses to the verifier once
                laws[i] = [q] * len(out[i]) if self.mode is ProposalMode.IID else list(child_laws)
        # Every rank grows the same tree: rank 0's (an unseeded draw uses each process's own generator).
        out = self.tp.broadcast_int_lists(out if self.tp.is_first else None, len(rows), logits.device)
        return list(zip(out, laws, strict=True))

    def _finish(self, t: _Tree) -> DraftTree:
        u = len(t.seq.token_ids)
        tokens = t.pad.tokens[u:]
        parents = [-1 if p < u else p - u for p in t.pad.parents[u:]]
        self._pads[t.seq.seq_id] = t.pad
        tree_id, scores = -1, None
        if t.laws and self.law_sink is not None:
            tree_id, self._next_tree_id = self._next_tree_id, self._next_tree_id + 1
            laws = DraftLaws.of(t.seq.seq_id, tree_id, t.laws)
            scores = laws.node_probs(tokens)  # q_i(x_i)
            self.law_sink([laws])
        return DraftTree(tokens, parents, tree_id, 0, most_probable_path(parents, scores))

    def forward(self, pieces: list[SeqForward], seq_ids: list[int | None]) -> torch.Tensor:
        """The verify forward: logits [R, V] in the pieces' order, as ``ModelRunner.forward`` returns them.
        ``seq_ids``: each piece's sequence (None for prompt chunks, which never reuse)."""
        pads, self._pads = self._pads, {}
        reuse = [sid is not None and _matches(pads.get(sid), p) for p, sid in zip(pieces, seq_ids, strict=True)]
        if not any(reuse):
            return self.runner.forward(pieces)
        rest = [p for p, r in zip(pieces, reuse, strict=True) if not r]
        mine = [(p, pads[sid]) for p, sid, r in zip(pieces, seq_ids, reuse, strict=True) if r]
        upper = self._upper([p for p, _ in mine], [h for _, pad in mine for h in pad.hidden])
        lower = self.runner.forward(rest) if rest else upper[:0]
        out, a, b = [], 0, 0
        for p, r in zip(pieces, reuse, strict=True):
            n = len(p.logit_nodes)
            if r:
                out.append(upper[a: a + n])
                a += n
            else:
                out.append(lower[b: b + n])
                b += n
        return torch.cat(out)

    def _upper(self, pieces: list[SeqForward], hidden: list[torch.Tensor]) -> torch.Tensor:
        """Layers L..N-1, the final norm and the head over whole pieces whose layer-L states are ``hidden``."""
        model = self.runner.model
        batch = build_batch(pieces, self.runner.block_size, self.runner.device)
        ctx = PagedContext(batch.meta, self.runner.cache, row_invariant=getattr(model, "row_invariant", False))
        h = run_layers(model, batch.input_ids, batch.positions, ctx, self.exit_layer, num_layers(model),
                       torch.stack(hidden))  # [T, H]
        h = model.model.norm(h)
        if batch.logit_range is not None:
            start, stop = batch.logit_range
            wanted = h[start:stop] if stop - start < h.shape[0] else h
        else:
            wanted = h.index_select(0, batch.logit_rows)
        return model.compute_logits(wanted).float()  # [R, V]


def _matches(pad: _Pad | None, piece: SeqForward) -> bool:
    """The pad holds exactly this piece's rows: same committed length, same tokens, all of them fresh."""
    return (pad is not None and piece.new_start == 0 and pad.base_len == piece.base_len
            and pad.tokens == piece.token_ids and len(pad.hidden) == len(piece.token_ids)
            and piece.parents == pad.parents)
