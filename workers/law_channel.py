"""q from the draft straight to the verifier: the compact exact form of the laws the candidates were drawn from.

Verification needs, for every candidate, the law it was actually drawn from (docs/architecture.md). Those laws are
[nodes, vocab] float32 per tree: at vocabulary 49,152 a batch of 32 eight-node trees is 50 MB. Only the target
rank that verifies reads them, so the draft worker hands them over directly (in-process: a shared ``LawStore``;
Ray: a zmq PUSH from draft rank 0 to target rank 0, see engine/execution/worker_actor.py) and the controller sends the
target only the tree's id.

In-process the draft's tensors are handed over as they are (``DraftLaws``). On a socket (``TreeLaws``),
compact and exact: a law is sent as its support, the token ids it gives mass > 0, with their float32
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


def first_tree_id(generation: int) -> int:
    """The first tree id a draft of this generation (1, 2, ... — a replacement is the next one) numbers its trees
    from: generations never share ids, so ``LawStore.fail(below=first_tree_id(g + 1))`` fails only generation
    g's (and older) trees while a replacement's laws go on arriving."""
    return (generation - 1) << 40


class LawsUnavailable(RuntimeError):
    """The laws of a tree being verified will not come: their sender died, or (last resort) never sent them."""


@dataclass
class TreeLaws:
    """The laws of one drafted tree (a msgpack message: int lists and raw float32 / int32 tensors)."""

    seq_id: int
    tree_id: int  # unique per draft worker, in drafting order
    vocab: int
    node_law: list[int]  # law index of every node
    sizes: list[int]  # per law: support size, or -1 for a dense law
    ids: Any = None  # int32 [sum of sparse sizes]: the support ids of the sparse laws, in law order
    probs: Any = None  # float32 [sum of sparse sizes]: their probabilities, aligned with ids
    dense: Any = None  # float32 [dense laws, vocab]: the dense laws, in law order


@dataclass
class DraftLaws:
    """A drafted tree's laws as the draft holds them: handed over as is in-process, packed for a socket."""

    seq_id: int
    tree_id: int
    node_law: list[int]  # law index of every node
    table: torch.Tensor  # [U, V] float32: the distinct laws

    @classmethod
    def of(cls, seq_id: int, tree_id: int, laws: list[torch.Tensor]) -> DraftLaws:
        """laws: the [V] law of every node, in node order; the same tensor object for nodes sharing a law."""
        index: dict[int, int] = {}
        node_law: list[int] = []
        unique: list[torch.Tensor] = []
        for law in laws:
            if id(law) not in index:
                index[id(law)] = len(unique)
                unique.append(law)
            node_law.append(index[id(law)])
        return cls(seq_id, tree_id, node_law, torch.stack(unique).float())

    def node_probs(self, tokens: list[int]) -> list[float]:
        """q_i(x_i): each node's probability under the law it was drawn from."""
        rows = torch.tensor(self.node_law, dtype=torch.long, device=self.table.device)
        cols = torch.tensor(tokens, dtype=torch.long, device=self.table.device)
        return self.table[rows, cols].tolist()

    def rows(self, num_nodes: int, device: torch.device | str) -> torch.Tensor:
        """[num_nodes, V]: the first nodes' laws (a tree pruned to a depth keeps a prefix of its nodes)."""
        index = torch.tensor(self.node_law[:num_nodes], dtype=torch.long, device=self.table.device)
        return self.table.index_select(0, index).to(device)


def pack_laws(laws: DraftLaws) -> TreeLaws:
    """The wire form: sparse laws as (ids, probabilities), the others dense; values bit for bit."""
    table = laws.table.cpu()  # [U, V]
    vocab = table.shape[1]
    counts = (table > 0).sum(dim=1).tolist()  # support sizes
    is_dense = [2 * c > vocab for c in counts]  # ids + probs would outweigh the dense row
    sparse = table[[i for i, d in enumerate(is_dense) if not d]]  # [Us, V]
    nz = sparse.nonzero()  # [S, 2], row by row, ids ascending: one pass for every sparse law
    return TreeLaws(laws.seq_id, laws.tree_id, vocab, laws.node_law,
                    [-1 if d else c for d, c in zip(is_dense, counts, strict=True)],
                    nz[:, 1].to(torch.int32), sparse[nz[:, 0], nz[:, 1]],
                    table if all(is_dense) else table[[i for i, d in enumerate(is_dense) if d]])


def unpack_laws(msg: TreeLaws, num_nodes: int, device: torch.device | str) -> torch.Tensor:
    """The first ``num_nodes`` nodes' laws as a dense [num_nodes, V] float32 tensor, bit-identical to what the
    draft sampled from (a tree pruned to a depth keeps a prefix of its nodes)."""
    rows: list[torch.Tensor] = []
    at = dense_at = 0
    for size in msg.sizes:
        if size < 0:
            rows.append(msg.dense[dense_at])
            dense_at += 1
        else:
            row = torch.zeros(msg.vocab, dtype=torch.float32)
            row[msg.ids[at: at + size].long()] = msg.probs[at: at + size]
            rows.append(row)
            at += size
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

    # The last resort for a draft that is alive but never sends a tree's laws (stuck). A dead draft is noticed by
    # the controller within seconds, which then fails the wait (``fail``): this timeout is never how a death is
    # found. The target worker sets it to the controller's per-step limit (WorkerConfig.step_timeout_s).
    timeout_s: float = 600.0
    _laws: dict[int, TreeLaws | DraftLaws] = field(default_factory=dict)
    _by_seq: dict[int, list[int]] = field(default_factory=dict)
    _finished: set[int] = field(default_factory=set)  # a late frame for these is dropped on arrival
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _error: str | None = None  # no tree's laws can arrive any more (the receiver failed)
    _lost_below: int = 0  # trees with a lower id can no longer arrive: the draft that numbered them died
    _lost_error: str = ""

    def put(self, laws: list[TreeLaws] | list[DraftLaws]) -> None:
        with self._cond:
            for t in laws:
                if t.seq_id in self._finished:
                    continue
                self._laws[t.tree_id] = t
                self._by_seq.setdefault(t.seq_id, []).append(t.tree_id)
            self._cond.notify_all()

    def fail(self, error: str, below: int | None = None) -> None:
        """Wake every waiter with ``error`` instead of letting it wait out the timeout: for every tree
        (``below`` None: the receiver is gone), or for the trees numbered below ``below`` (their draft died; a
        replacement numbers its trees from there on, engine/execution/worker_actor.py ``connect_laws``)."""
        with self._cond:
            if below is None:
                self._error = error
            elif below > self._lost_below:
                self._lost_below, self._lost_error = below, error
            self._cond.notify_all()

    def take(self, seq_id: int, tree_id: int, num_nodes: int, device: torch.device | str) -> torch.Tensor:
        """[num_nodes, V]: the laws of tree ``tree_id``, waiting for them if they are still on the way.

        Raises LawsUnavailable once they cannot come (``fail``), or after ``timeout_s`` as a last resort."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while tree_id not in self._laws:
                left = deadline - time.monotonic()
                if self._error is not None:
                    raise LawsUnavailable(f"the draft's laws for tree {tree_id} cannot arrive: {self._error}")
                if tree_id < self._lost_below:
                    raise LawsUnavailable(f"the draft's laws for tree {tree_id} cannot arrive: {self._lost_error}")
                if left <= 0:
                    raise LawsUnavailable(
                        f"the draft's laws for tree {tree_id} (sequence {seq_id}) did not arrive within "
                        f"{self.timeout_s:g} s. A dead draft worker is noticed within seconds and ends this wait, "
                        "so the draft is alive but stuck (step_timeout_s is this last-resort limit)")
                self._cond.wait(min(left, 1.0))
            msg = self._laws[tree_id]
            older = [t for t in self._by_seq.get(seq_id, []) if t < tree_id]
            for t in older:
                self._laws.pop(t, None)
            self._by_seq[seq_id] = [t for t in self._by_seq.get(seq_id, []) if t >= tree_id]
        if isinstance(msg, DraftLaws):  # handed over in-process: no packing
            return msg.rows(num_nodes, device)
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
