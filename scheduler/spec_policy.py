"""Speculation policy: the shape of the candidate tree drafted for each request each round (stdlib only).

A tree is described by its branching per depth: ``(2, 2, 1)`` means the root gets 2 children, each of those 2,
each of those 1: depth 3, 2 + 4 + 4 = 10 nodes. A chain of K tokens is ``(1,) * K``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeShape:
    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.branching:
            raise ValueError("tree branching must have at least one depth")
        for w in self.branching:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"tree branching entries must be integers >= 1, got {list(self.branching)}")

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls((1,) * k)

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def level_sizes(self) -> list[int]:
        sizes, n = [], 1
        for w in self.branching:
            n *= w
            sizes.append(n)
        return sizes

    @property
    def num_nodes(self) -> int:
        return sum(self.level_sizes)
