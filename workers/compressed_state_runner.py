"""Runs a compressed-state model (DeepSeek-V4) behind the same interface as ``ModelRunner``.

The workers speak in ``SeqForward`` pieces (scratch node j of a sequence sits at position base_len + depth(j))
and ``CommitSpec`` paths; this runner keeps one ``SeqState`` per sequence instead of paged KV and maps both
onto ``workers.compressed_state``:

- ``forward``: one ``TreePlan`` per piece, one model pass over all of them; each piece's scratch rows are kept
  until its sequence's next call;
- ``commit``: installs the path's rows (in-flight chain + accepted nodes) and drops the rest;
- a draft grows its tree over several calls of one round (``new_start > 0``): each such call recomputes the
  round's earlier nodes with the new ones, so the scratch always holds the whole tree;
- a call whose ``base_len`` is below the committed position (a pipelined draft taking back predicted tokens)
  undoes the last commit (its overwritten rows were saved) and re-commits the part that stays;
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
    tokens: list[int]  # of every scratch node, so a later call of the same round can extend the tree


class CompressedStateRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, device: torch.device | str) -> None:
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.states: dict[int, SeqState] = {}
        self.pending: dict[int, _Pending] = {}
        self.last_commit: dict[int, tuple[cs.Undo, _Pending, list[int]]] = {}
        self.rollbacks = 0  # commits taken back (pipelined drafts)

    def _state(self, piece: SeqForward) -> SeqState:
        if not piece.block_table:
            raise ValueError("a compressed-state sequence needs a block table (its first block names it)")
        key = piece.block_table[0]
        if piece.new_start:  # a draft growing its tree: same round, nothing committed since the last call
            pend = self.pending.get(key)
            if pend is None or pend.plan.num_nodes != piece.new_start or piece.base_len != self.states[key].position:
                raise ValueError(f"sequence with first block {key}: a call extending scratch nodes "
                                 f"0..{piece.new_start} that its last call did not leave")
            return self.states[key]
        if piece.base_len == 0:
            self.states[key] = SeqState.empty(self.config, self.device)
            self.pending.pop(key, None)
            self.last_commit.pop(key, None)
        state = self.states.get(key)
        if state is None:
            raise ValueError(f"sequence with first block {key} has no compressed state (base_len {piece.base_len})")
        if piece.base_len < state.position:
            self._roll_back(key, piece.base_len)
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
        # Kept until the sequence's next commit: a pipelined draft may take back the tail of this one.
        self.last_commit[key] = (cs.save_undo(self.states[key], pend.plan, path), pend, path)
        cs.commit(self.states[key], pend.plan, pend.scratch, path)

    def _roll_back(self, key: int, base_len: int) -> None:
        """Back to ``base_len`` tokens: undo the last commit, then commit again the part of it that stays.
        (With paged KV a shorter base_len just lets the next writes overwrite; here rows were replaced.)"""
        last = self.last_commit.pop(key, None)
        if last is None or base_len < last[0].position:
            raise ValueError(f"sequence with first block {key}: cannot roll back to {base_len} tokens (only the "
                             "last commit can be taken back)")
        undo, pend, path = last
        self.rollbacks += 1
        cs.apply_undo(self.states[key], undo)
        cs.commit(self.states[key], pend.plan, pend.scratch, path[: base_len - undo.position])

    @torch.inference_mode()
    def forward(self, seqs: list[SeqForward]) -> torch.Tensor:
        """Every piece's nodes in one pass; logits [R, V] (float32) of the requested nodes, in order."""
        if not seqs:
            return torch.empty(0)
        requests = []
        for piece in seqs:
            state = self._state(piece)
            plan = cs.make_plan(self.config, state.position, piece.parents, self.device)
            # A call that extends the last one recomputes its earlier nodes too (exact, and cheap for a draft:
            # a tree has a few nodes), so the scratch always covers the whole tree of the round.
            earlier = self.pending[piece.block_table[0]].tokens if piece.new_start else []
            requests.append((state, plan, earlier + list(piece.token_ids)))
        logits, scratch = self.model.run(requests)  # [T, V]
        rows, start = [], 0
        for piece, (_, plan, tokens), sc in zip(seqs, requests, scratch, strict=True):
            self.pending[piece.block_table[0]] = _Pending(plan, sc, tokens)
            rows += [start + j for j in piece.logit_nodes]  # node indices of the whole tree
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
