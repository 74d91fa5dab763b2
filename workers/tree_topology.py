"""Tree topology on plain int lists: the one description of a candidate tree's shape (stdlib only).

A tree of N nodes is ``parents`` (length N): ``parents[i]`` is node i's parent, -1 for a child of the root,
always < i (topological order), siblings in drawn (= tried) order. Drafts grow trees one depth at a time, so
the nodes of depth < d always form a prefix of the node list: pruning a tree to a depth keeps a prefix.

A round's scratch pad on either worker starts with the ``u`` in-flight tokens as a chain (scratch 0..u-1),
then the tree's nodes (node i at scratch u + i, its root being the last in-flight token): ``scratch_parents``.
"""

from __future__ import annotations


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node, 0 for a child of the root."""
    depths: list[int] = []
    for j, p in enumerate(parents):
        if p >= j:
            raise ValueError(f"parents must be topologically ordered: node {j} has parent {p}")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def children_lists(parents: list[int]) -> list[list[int]]:
    """children[0]: the root's children; children[i + 1]: node i's, in drawn order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def is_chain(parents: list[int]) -> bool:
    """True when node j's parent is j - 1 for every node (a prompt chunk, a decode step, a chain of candidates)."""
    n = len(parents)
    return n == 0 or (parents[0] == -1 and parents[-1] == n - 2 and parents == list(range(-1, n - 1)))


def prune_to_depth(parents: list[int], max_depth: int) -> int:
    """How many leading nodes have depth < max_depth (a tree pre-drafted deeper than a request may go)."""
    depths = node_depths(parents)
    keep = sum(1 for d in depths if d < max_depth)
    if any(d >= max_depth for d in depths[:keep]):
        raise ValueError(f"nodes are not in depth order: {parents}")
    return keep


def level_count(branching: list[int] | tuple[int, ...], depth: int) -> int:
    """Nodes of a full tree with ``branching`` cut to ``depth`` levels: (2, 2, 1) at depth 2 has 2 + 4."""
    total, width = 0, 1
    for w in list(branching)[:depth]:
        width *= w
        total += width
    return total


def scratch_parents(num_inflight: int, tree_parents: list[int]) -> list[int]:
    """Scratch parents of a round: the in-flight chain, then the tree below its last token."""
    u = num_inflight
    return list(range(-1, u - 1)) + [u - 1 if p < 0 else u + p for p in tree_parents]


def most_probable_path(parents: list[int], scores: list[float] | None) -> list[int]:
    """Root to leaf, taking at each node the child with the highest score (the draft's q of its own token);
    without scores the first child (greedy trees list the draft's top tokens first)."""
    children = children_lists(parents)
    path: list[int] = []
    slot = 0
    while children[slot]:
        kids = children[slot]
        best = kids[0] if scores is None else max(kids, key=lambda c: scores[c])
        path.append(best)
        slot = best + 1
    return path
