"""A depth-bounded suffix trie with counts: every substring of at most ``max_depth`` tokens, with how often it
occurred, and the tree of its most frequent continuations (SuffixDecoding, Oliaro et al. 2024).

Two ways in, both O(max_depth) per token: ``append`` extends one growing sequence (a request's prompt and
output, token by token: it keeps the nodes of the sequence's current suffixes), ``add`` / ``remove`` put a
whole finished sequence in or take it out again (the cross-request cache; removal deletes nodes whose count
drops to 0, so memory follows what is cached). ``num_nodes`` is the memory measure.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] | None = None  # None for a leaf: most nodes are leaves
        self.count = 0  # occurrences of the substring from the root to here


@dataclass
class Proposal:
    tokens: list[int]  # the tree in depth order, siblings most frequent first
    parents: list[int]  # -1: child of the matched context
    score: float  # expected accepted tokens if the counts are the law: the sum of the nodes' path probabilities
    match_len: int


@dataclass
class SuffixTrie:
    max_depth: int
    root: Node = field(default_factory=Node)
    num_nodes: int = 0
    _active: list[Node] = field(default_factory=list)  # ``append``: nodes of the suffixes of length 1 .. depth - 1
    num_appended: int = 0
    start: int = 0  # ``append``: the oldest position whose substrings are still indexed (``drop_oldest``)

    def _child(self, node: Node, t: int) -> Node:
        if node.children is None:
            node.children = {}
        child = node.children.get(t)
        if child is None:
            child = node.children[t] = Node()
            self.num_nodes += 1
        return child

    def append(self, tokens: Sequence[int]) -> None:
        """Extend the growing sequence: every suffix ending at each new token gains one occurrence."""
        d = self.max_depth
        for t in tokens:
            nxt = []
            for node in [self.root, *self._active]:
                child = self._child(node, t)
                child.count += 1
                nxt.append(child)
            self._active = nxt[: d - 1]  # a suffix of depth d cannot grow further
            self.num_appended += 1

    def add(self, tokens: Sequence[int]) -> None:
        """A whole sequence in: each start position's path (at most max_depth long) gains one occurrence."""
        for j in range(len(tokens)):
            node = self.root
            for t in tokens[j: j + self.max_depth]:
                node = self._child(node, t)
                node.count += 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: counts drop, nodes that reach 0 are deleted."""
        for j in range(len(tokens)):
            self._remove_path(tokens[j: j + self.max_depth])

    def drop_oldest(self, tokens: Sequence[int], keep: int) -> None:
        """Of the appended sequence ``tokens``, index only the substrings starting in its last ``keep`` positions
        (``keep`` >= max_depth, so the active suffixes stay): the older starts' paths go, O(max_depth) each."""
        keep = max(keep, self.max_depth)
        while self.num_appended - self.start > keep:
            j = self.start
            self._remove_path(tokens[j: min(j + self.max_depth, self.num_appended)])
            self.start += 1

    def _remove_path(self, path: Sequence[int]) -> None:
        node = self.root
        for t in path:
            child = node.children[t]  # type: ignore[index]
            child.count -= 1
            if child.count == 0:
                self.num_nodes -= _size(child)
                del node.children[t]  # type: ignore[union-attr]
                if not node.children:
                    node.children = None
                return  # its whole subtree went with it
            node = child

    def match(self, context: Sequence[int], own: bool) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``context`` (at most max_depth - 1 tokens) that has a continuation.
        ``own``: the trie holds ``context`` itself (``append``): its active nodes are the suffixes' nodes."""
        if own:
            for length in range(len(self._active), 0, -1):
                node = self._active[length - 1]
                if node.children:
                    return node, length
            return None, 0
        for length in range(min(len(context), self.max_depth - 1), 0, -1):
            node = self.root
            for t in context[len(context) - length:]:
                node = node.children.get(t) if node.children else None  # type: ignore[assignment]
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def propose(self, context: Sequence[int], own: bool, max_nodes: int, max_depth: int, spec_factor: float,
                min_prob: float) -> Proposal | None:
        """The most probable continuations of the longest match: nodes taken best first by path probability
        (count / the counts of its siblings and itself, multiplied down the path), while at least ``min_prob``,
        at most ceil(spec_factor x match length) and ``max_nodes`` of them, ``max_depth`` deep."""
        node, match_len = self.match(context, own)
        if node is None:
            return None
        budget = min(max_nodes, math.ceil(spec_factor * match_len))
        depth_left = min(max_depth, self.max_depth - match_len)
        chosen: list[tuple[int, int, int, float]] = []  # (token, parent index, depth, path prob)
        heap: list[tuple[float, int, int, int, Node, int]] = []  # (-prob, seq, parent index, token, node, depth)
        seq = 0

        def push(parent: Node, parent_idx: int, prob: float, depth: int) -> None:
            nonlocal seq
            if not parent.children or depth > depth_left:
                return
            total = sum(c.count for c in parent.children.values())
            for t, c in parent.children.items():
                p = prob * c.count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, seq, parent_idx, t, c, depth))
                    seq += 1

        push(node, -1, 1.0, 1)
        while heap and len(chosen) < budget:
            neg_p, _, parent_idx, t, c, depth = heapq.heappop(heap)
            chosen.append((t, parent_idx, depth, -neg_p))
            push(c, len(chosen) - 1, -neg_p, depth + 1)
        if not chosen:
            return None
        # Depth order (the verifier's layout), siblings in the order they were chosen (most probable first).
        order = sorted(range(len(chosen)), key=lambda i: (chosen[i][2], i))
        where = {old: new for new, old in enumerate(order)}
        tokens = [chosen[i][0] for i in order]
        parents = [where[chosen[i][1]] if chosen[i][1] >= 0 else -1 for i in order]
        return Proposal(tokens, parents, sum(c[3] for c in chosen), match_len)


def _size(node: Node) -> int:
    """Nodes in the subtree rooted at ``node`` (itself included)."""
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n
