"""q from the draft straight to the verifier: the compact exact form of the laws the candidates were drawn from.

Verification needs, for every candidate, the law it was actually drawn from (docs/architecture.md). Those laws are
[nodes, vocab] float32 per tree: at vocabulary 49,152 a batch of 32 eight-node trees is 50 MB. Only the target
rank that verifies reads them, so the draft worker hands them over directly (in-process: a shared ``LawStore``;
Ray: a zmq PUSH from draft rank 0 to target rank 0, see engine/worker_actor.py) and the controller sends the
target only the tree's id.

Compact and exact: a law is sent as its support, the token ids it gives mass > 0, with their float32
probabilities exactly as sampled (the bits the draft drew from: no rounding, no approximation). After top-k /
top-p / min-p the support is small; a law whose support is more than half the vocabulary (plain temperature
sampling) goes dense, which is never larger than before. Siblings drawn i.i.d. share their parent's law: it is
sent once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TreeLaws:
    """The laws of one drafted tree (a msgpack message: int lists and raw float32 / int32 tensors)."""

    seq_id: int
    tree_id: int  # unique per draft worker, in drafting order
    vocab: int
    node_law: list[int]  # law index of every node
    sizes: list[int]  # per law: support size, or -1 for a dense law (``vocab`` probabilities, every id)
    ids: Any = None  # int32 [sum of sparse sizes]: the support ids of the sparse laws, in law order
    probs: Any = None  # float32 [sum of sizes, a dense law counting vocab]: the probabilities, in law order


def pack_laws(seq_id: int, tree_id: int, laws: list[torch.Tensor], vocab: int) -> TreeLaws:
    """laws: the [V] law of every node, in node order; the same tensor object for nodes that share a law."""
    index: dict[int, int] = {}
    node_law: list[int] = []
    unique: list[torch.Tensor] = []
    for law in laws:
        key = id(law)
        if key not in index:
            index[key] = len(unique)
            unique.append(law)
        node_law.append(index[key])
    sizes: list[int] = []
    ids: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for law in unique:
        law = law.float().cpu()
        support = law.nonzero().squeeze(1)  # [S]
        if 2 * support.numel() > vocab:  # ids + probs would outweigh the dense row
            sizes.append(-1)
            probs.append(law)
        else:
            sizes.append(support.numel())
            ids.append(support.to(torch.int32))
            probs.append(law.index_select(0, support))
    empty_i, empty_f = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.float32)
    return TreeLaws(seq_id, tree_id, vocab, node_law, sizes, torch.cat(ids) if ids else empty_i,
                    torch.cat(probs) if probs else empty_f)


def unpack_laws(msg: TreeLaws, num_nodes: int, device: torch.device | str) -> torch.Tensor:
    """The first ``num_nodes`` nodes' laws as a dense [num_nodes, V] float32 tensor, bit-identical to what the
    draft sampled from (a tree pruned to a depth keeps a prefix of its nodes)."""
    rows: list[torch.Tensor] = []
    id_at = prob_at = 0
    for size in msg.sizes:
        if size < 0:
            rows.append(msg.probs[prob_at: prob_at + msg.vocab])
            prob_at += msg.vocab
        else:
            row = torch.zeros(msg.vocab, dtype=torch.float32)
            row[msg.ids[id_at: id_at + size].long()] = msg.probs[prob_at: prob_at + size]
            rows.append(row)
            id_at += size
            prob_at += size
    if num_nodes == 0:
        return torch.empty(0, msg.vocab, device=device)
    index = torch.tensor(msg.node_law[:num_nodes], dtype=torch.long)
    return torch.stack(rows).index_select(0, index).to(device)  # [num_nodes, V]


@dataclass
class LawStore:
    """The verifier's side: laws by tree id, put by the draft (or a receiving thread), taken by verification.

    A sequence's trees arrive in drafting order; verifying tree t makes its older trees useless (they were
    drafted for prefixes that did not come true), so they are dropped then, and all of them when the sequence
    finishes: at most a round's pre-drafted trees per sequence stay.
    """

    timeout_s: float = 600.0
    _laws: dict[int, TreeLaws] = field(default_factory=dict)
    _by_seq: dict[int, list[int]] = field(default_factory=dict)
    _finished: set[int] = field(default_factory=set)  # a late frame for these is dropped on arrival
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _error: str | None = None

    def put(self, laws: list[TreeLaws]) -> None:
        with self._cond:
            for t in laws:
                if t.seq_id in self._finished:
                    continue
                self._laws[t.tree_id] = t
                self._by_seq.setdefault(t.seq_id, []).append(t.tree_id)
            self._cond.notify_all()

    def fail(self, error: str) -> None:
        """The sender is gone: wake every waiter with this error instead of letting it wait out the timeout."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def take(self, seq_id: int, tree_id: int, num_nodes: int, device: torch.device | str) -> torch.Tensor:
        """[num_nodes, V]: the laws of tree ``tree_id``, waiting for them if they are still on the way."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while tree_id not in self._laws:
                left = deadline - time.monotonic()
                if self._error is not None:
                    raise RuntimeError(f"the draft's laws for tree {tree_id} cannot arrive: {self._error}")
                if left <= 0:
                    raise TimeoutError(f"the draft's laws for tree {tree_id} (sequence {seq_id}) did not arrive "
                                       f"within {self.timeout_s:g} s: is the draft worker alive?")
                self._cond.wait(min(left, 1.0))
            msg = self._laws[tree_id]
            older = [t for t in self._by_seq.get(seq_id, []) if t < tree_id]
            for t in older:
                self._laws.pop(t, None)
            self._by_seq[seq_id] = [t for t in self._by_seq.get(seq_id, []) if t >= tree_id]
        return unpack_laws(msg, num_nodes, device)

    def drop(self, seq_ids: list[int]) -> None:
        """Finished sequences (ids are never reused)."""
        with self._cond:
            self._finished.update(seq_ids)
            for s in seq_ids:
                for t in self._by_seq.pop(s, []):
                    self._laws.pop(t, None)

    def __len__(self) -> int:
        return len(self._laws)
