"""The target worker's self-drafter: K drafts from layers 0..L-1 + the exit, then a verify that starts at layer L.

The design is in workers/layer_skip/__init__.py. ``draft`` runs the early passes and keeps, per sequence, a pad:
the rows' layer-L hidden states, their tokens and base length. ``forward`` is the target's verify forward with
the pads used: pieces whose rows equal a pad's run layers L..N-1 from it; every other piece (prompt chunks, a round
drafted elsewhere, a pad that does not match) runs the whole model as before. Pads live for one round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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
from workers.sampling import logits_to_probs, sample
from workers.streams import stream
from workers.worker_base import sampling_batch


@dataclass
class _Pad:
    base_len: int
    tokens: list[int]  # in-flight then drafted tokens whose layers < L have run, in scratch order
    hidden: list[torch.Tensor]  # per row: [H], the input of layer L


@dataclass
class _Chain:
    seq: SelfDraftSeq
    pad: _Pad
    laws: list[torch.Tensor]  # per drafted token: [V], the law it was drawn from

    def piece(self, new: list[int], logits: bool) -> SeqForward:
        n = len(self.pad.tokens)
        start = n - len(new)
        return SeqForward(self.seq.block_table, self.seq.base_len, list(range(-1, n - 1)), new, new_start=start,
                          logit_nodes=[n - 1] if logits else [])


class SelfDrafter:
    def __init__(self, runner: ModelRunner, exit_layer: int, exit_head: ExitHead, seed_salt: int,
                 law_sink: Callable[[list[DraftLaws]], None] | None, tp: TPGroup | None = None) -> None:
        n = num_layers(runner.model)
        if not 1 <= exit_layer <= n - 1:
            raise ValueError(f"exit_layer must be in 1 .. {n - 1} (the target has {n} layers), got {exit_layer}")
        self.runner = runner
        self.exit_layer = exit_layer
        self.exit = exit_head
        self.seed_salt = seed_salt  # the draft's streams: never the verifier's (TARGET_SALT)
        self.law_sink = law_sink  # the verifying rank's law store (None on the other tensor-parallel ranks)
        self.tp = tp or TPGroup.single()
        self._pads: dict[int, _Pad] = {}
        self._next_tree_id = 0

    @torch.inference_mode()
    def draft(self, msg: SelfDraftStep) -> SelfDraftOutput:
        start = time.perf_counter()
        self._pads = {}
        chains = [_Chain(s, _Pad(s.base_len, list(s.token_ids), []), []) for s in msg.seqs if s.num_tokens > 0]
        new = {id(c): list(c.seq.token_ids) for c in chains}  # this pass's rows: the in-flight tokens first
        live = [c for c in chains if c.seq.token_ids]
        while live:
            wants = [len(c.pad.tokens) - len(c.seq.token_ids) < c.seq.num_tokens for c in live]
            hidden, rows = self._early([c.piece(new[id(c)], w) for c, w in zip(live, wants, strict=True)])
            at = 0
            for c in live:
                k = len(new[id(c)])
                c.pad.hidden += list(hidden[at: at + k])
                at += k
            drafting = [c for c, w in zip(live, wants, strict=True) if w]
            if drafting:
                for c, tok in zip(drafting, self._draw(drafting, self.exit(rows)), strict=True):
                    c.pad.tokens.append(tok)
                    new[id(c)] = [tok]
            live = drafting  # the K-th draft's early layers run once more, without the exit
        trees = {c.seq.seq_id: self._finish(c) for c in chains}
        empty = DraftTree([], [], -1, 0, [])
        return SelfDraftOutput([trees.get(s.seq_id, empty) for s in msg.seqs], time.perf_counter() - start)

    def _early(self, pieces: list[SeqForward]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0..L-1 over the pieces' new rows: (their layer-L hidden states [T, H], the logit rows' [R, H])."""
        model = self.runner.model
        batch = build_batch(pieces, self.runner.block_size, self.runner.device)
        ctx = PagedContext(batch.meta, self.runner.cache, row_invariant=getattr(model, "row_invariant", False))
        hidden = run_layers(model, batch.input_ids, batch.positions, ctx, 0, self.exit_layer)  # [T, H]
        return hidden, hidden.index_select(0, batch.logit_rows)

    def _draw(self, chains: list[_Chain], logits: torch.Tensor) -> list[int]:
        """One token per chain from the exit's logits [B, V]: argmax for greedy requests, else a draw from the
        transformed softmax, whose row is recorded as that token's law."""
        out = logits.argmax(dim=-1).tolist()  # greedy rows: no law is recorded (verified as one-hot)
        drawing = [i for i, c in enumerate(chains) if not c.seq.sampling.greedy]
        if drawing:
            rows = logits[drawing]  # [S, V]
            specs = [chains[i].seq.sampling for i in drawing]
            probs = logits_to_probs(rows, sampling_batch(specs, [1] * len(specs), logits.device))  # [S, V]
            gens = [stream(chains[i].seq.sampling, self.seed_salt,
                           chains[i].seq.base_len + len(chains[i].pad.tokens), logits.device) for i in drawing]
            for i, law, tok in zip(drawing, probs, sample(probs, gens).tolist(), strict=True):
                chains[i].laws.append(law)
                out[i] = tok
        # Every rank feeds the same tokens next: rank 0's (an unseeded draw uses each process's own generator).
        return self.tp.broadcast_int_lists([out] if self.tp.is_first else None, 1, logits.device)[0]

    def _finish(self, c: _Chain) -> DraftTree:
        drafted = c.pad.tokens[len(c.seq.token_ids):]
        self._pads[c.seq.seq_id] = c.pad
        tree_id = -1
        if c.laws and self.law_sink is not None:
            tree_id, self._next_tree_id = self._next_tree_id, self._next_tree_id + 1
            self.law_sink([DraftLaws.of(c.seq.seq_id, tree_id, c.laws)])
        parents = list(range(-1, len(drafted) - 1))
        return DraftTree(drafted, parents, tree_id, 0, list(range(len(drafted))))

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
            and piece.parents == list(range(-1, len(piece.parents) - 1)))
