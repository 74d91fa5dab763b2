"""Speculation policy: the shape and depth of the candidate tree drafted for each request each round (stdlib only).

A tree is described by its branching per depth: ``(2, 2, 1)`` means the root gets 2 children, each of those 2,
each of those 1: depth 3, 2 + 4 + 4 = 10 nodes. A chain of K tokens is ``(1,) * K``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.adaptive.acceptance import AcceptanceTracker
from scheduler.request import Request


def branching_nodes(branching: Sequence[int]) -> int:
    """Nodes of a tree with this branching per depth (a chain of K: K)."""
    total, n = 0, 1
    for w in branching:
        n *= w
        total += n
    return total


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


@dataclass(frozen=True)
class SpecPolicy:
    """How deep each request's tree goes this round: the configured shape, cut where drafting cannot pay.

    Every policy answers ``plan``: the branching of each decoding request's round (``()``: plain decode); the
    scheduler reserves exactly those nodes. This one is the fixed depth; scheduler/adaptive/ chooses by
    measured costs and acceptance, ``BatchSizeSchedule`` by vLLM's batch-size table.
    """

    measures_costs = False  # a fixed schedule: the engine need not time its steps for it

    tree: TreeShape
    max_model_len: int  # the target's context
    draft_max_len: int  # the draft's context: past it the draft still runs but proposes poorly (vLLM stops too)
    # Measured acceptance (its contents change; the policy does not): the pipelined drafter ranks outcomes by it.
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker, compare=False, repr=False)

    def depth(self, num_tokens: int, remaining_tokens: int) -> int:
        """No deeper than the tokens the request may still emit (one is the recovered/bonus token), or its
        context; candidates sit at positions num_tokens .. num_tokens + depth - 1, inside the draft's context."""
        room = min(remaining_tokens, self.max_model_len - num_tokens)
        return max(0, min(self.tree.depth, room - 1, self.draft_max_len - num_tokens))

    def num_nodes(self, depth: int) -> int:
        """Nodes of the tree cut to ``depth`` levels: what the target verifies, at most."""
        return sum(self.tree.level_sizes[:depth])

    def cap(self, req: Request) -> int:
        return self.depth(req.num_tokens, req.remaining_tokens)

    def plan(self, reqs: Sequence[Request], prefill: bool = False) -> list[tuple[int, ...]]:
        """Each request's round (``prefill``: prompt chunks will share the step)."""
        return [self.tree.branching[: self.cap(r)] for r in reqs]

    def observe_round(self, req: Request, branching: tuple[int, ...], num_accepted: int) -> None:
        self.acceptance.observe(req.params.greedy, any(w > 1 for w in branching), len(branching), num_accepted)

    def reach(self, greedy: bool, depth: int) -> list[float]:
        """P(at least d candidates accepted), d = 1 .. depth, as measured."""
        return self.acceptance.reach(greedy, depth)

    def forget(self, seq_id: int) -> None:
        """A finished request: nothing of it is kept (acceptance is measured per regime, not per request)."""


@dataclass(frozen=True)
class BatchSizeSchedule(SpecPolicy):
    """vLLM's ``num_speculative_tokens_per_batch_size``: depth by the number of decoding requests, a fixed
    schedule (``table``: (smallest batch size, depth) pairs, ascending; below the first entry: full depth)."""

    table: tuple[tuple[int, int], ...] = ()

    def depth_for_batch(self, batch_size: int) -> int:
        k = self.tree.depth
        for size, depth in self.table:
            if batch_size >= size:
                k = depth
        return k

    def plan(self, reqs: Sequence[Request], prefill: bool = False) -> list[tuple[int, ...]]:
        k = self.depth_for_batch(len(reqs))
        return [self.tree.branching[: min(k, self.cap(r))] for r in reqs]
