"""Runs a compressed-state model (DeepSeek-V4) behind the same interface as ``ModelRunner``.

The workers speak in ``SeqForward`` pieces (scratch node j of a sequence sits at position base_len + depth(j))
and ``CommitSpec`` paths; this runner keeps one ``SeqState`` per sequence instead of paged KV and maps both
onto ``workers.compressed_state``:

- ``forward``: one ``TreePlan`` per piece, one model pass over all of them; each piece's scratch rows are kept
  until its sequence's next call;
- ``commit``: installs the path's rows (in-flight chain + accepted nodes) and drops the rest;
- a prefill chunk is never committed explicitly (with paged KV its nodes are already in place): when a
  sequence comes back with ``base_len`` past its committed position, the leading chain of its last scratch
  is installed first -- exactly what "already in place" means for the paged cache.

Sequences are identified by the first block of their block table (what a piece carries; a block belongs to
one live sequence). A piece with ``base_len == 0`` starts a fresh state (a new, or preempted and restarted,
sequence), which also reclaims the state of a finished sequence whose first block was reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers import compressed_state as cs
from workers.compressed_state import LayerScratch, SeqState, TreePlan
from workers.input_batch import SeqForward
from workers.messages import CommitSpec
from workers.models.deepseek_v4 import DeepseekV4ForCausalLM


@dataclass
class _Pending:
    plan: TreePlan
    scratch: list[LayerScratch]


class CompressedStateRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, device: torch.device | str) -> None:
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.states: dict[int, SeqState] = {}
        self.pending: dict[int, _Pending] = {}

    def _state(self, piece: SeqForward) -> SeqState:
        if not piece.block_table:
            raise ValueError("a compressed-state sequence needs a block table (its first block names it)")
        key = piece.block_table[0]
        if piece.new_start:
            raise NotImplementedError("compressed-state models do not yet run as drafts (pieces with new_start)")
        if piece.base_len == 0:
            self.states[key] = SeqState.empty(self.config, self.device)
            self.pending.pop(key, None)
        state = self.states.get(key)
        if state is None:
            raise ValueError(f"sequence with first block {key} has no compressed state (base_len {piece.base_len})")
        gap = piece.base_len - state.position
        if gap > 0:  # last call's leading chain is now committed (a prefill chunk)
            self._install(key, list(range(gap)))
        if piece.base_len != state.position:
            raise ValueError(f"sequence with first block {key}: base_len {piece.base_len} but {state.position} "
                             "tokens committed")
        return state

    def _install(self, key: int, path: list[int]) -> None:
        pend = self.pending.pop(key, None)
        if pend is None or len(path) > pend.plan.num_nodes:
            raise ValueError(f"sequence with first block {key}: nothing in scratch to commit for {path}")
        cs.commit(self.states[key], pend.plan, pend.scratch, path)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqForward]) -> torch.Tensor:
        """Every piece's nodes in one pass; logits [R, V] (float32) of the requested nodes, in order."""
        if not seqs:
            return torch.empty(0)
        requests = []
        for piece in seqs:
            state = self._state(piece)
            plan = cs.make_plan(self.config, state.position, piece.parents, self.device)
            requests.append((state, plan, piece.token_ids))
        logits, scratch = self.model.run(requests)  # [T, V]
        rows, start = [], 0
        for piece, (_, plan, _), sc in zip(seqs, requests, scratch, strict=True):
            self.pending[piece.block_table[0]] = _Pending(plan, sc)
            rows += [start + j for j in piece.logit_nodes]
            start += plan.num_nodes
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))

    def commit(self, commits: list[CommitSpec]) -> None:
        for c in commits:
            key = c.block_table[0]
            if self.states[key].position != c.base_len:
                raise ValueError(f"commit at base_len {c.base_len}, but {self.states[key].position} committed")
            self._install(key, c.path)

    def scratch_bytes(self) -> int:
        """Bytes of the scratch rows held for the last forward (per-branch state: rows each node wrote)."""
        return sum(cs.scratch_nbytes(p.scratch) for p in self.pending.values())
