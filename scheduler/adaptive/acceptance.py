"""Per-position acceptance estimates, one per regime (greedy or sampled) and kind (chain or tree) (stdlib only).

``alpha[j]``: the chance the candidate at depth j + 1 is accepted given the ones above it were. A round that
accepted ``a`` of ``d`` tried positions 0 .. min(a, d - 1). E[tokens of a depth-k round] = 1 + sum_j prod alpha.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.adaptive.config import AdaptiveConfig


@dataclass
class PositionCounts:
    """Exponentially weighted (accepted, tried) per position; positions not reached age at ``idle_decay``, so a
    depth no longer reached drifts back to its prior instead of keeping the miss that ended it."""

    decay: float
    idle_decay: float
    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def observe(self, depth: int, num_accepted: int) -> None:
        reached = min(num_accepted + 1, depth)
        while len(self.tried) < reached:
            self.accepted.append(0.0)
            self.tried.append(0.0)
        for j in range(len(self.tried)):
            if j < reached:
                self.accepted[j] = self.decay * self.accepted[j] + (j < num_accepted)
                self.tried[j] = self.decay * self.tried[j] + 1.0
            else:
                self.accepted[j] *= self.idle_decay
                self.tried[j] *= self.idle_decay

    def rate(self, j: int, prior: float, prior_weight: float) -> float:
        a, t = (self.accepted[j], self.tried[j]) if j < len(self.tried) else (0.0, 0.0)
        return (a + prior_weight * prior) / (t + prior_weight)

    def rounds(self, j: int = 0) -> float:
        return self.tried[j] if j < len(self.tried) else 0.0


@dataclass
class AcceptanceTracker:
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    _counts: dict[tuple[bool, bool], PositionCounts] = field(default_factory=dict)  # (greedy, tree) -> counts
    _seen: dict[bool, int] = field(default_factory=dict)  # greedy -> speculative rounds observed

    def _of(self, greedy: bool, tree: bool) -> PositionCounts:
        if (greedy, tree) not in self._counts:
            self._counts[greedy, tree] = PositionCounts(self.config.acceptance_decay, self.config.idle_decay)
        return self._counts[greedy, tree]

    def observe(self, greedy: bool, tree: bool, depth: int, num_accepted: int) -> None:
        if depth > 0:
            self._seen[greedy] = self._seen.get(greedy, 0) + 1
            self._of(greedy, tree).observe(depth, num_accepted)

    def rates(self, greedy: bool, depth: int, widths: tuple[int, ...] | None = None) -> list[float]:
        """Chains, or a tree with ``widths`` siblings per level. A position's prior is the rate above it (an
        untried depth looks like the deepest measured one); a chain position only tree rounds tried takes their
        rate; a tree level's prior is the chain's (a tree wins once its own rounds show the gain)."""
        chain, tree = self._of(greedy, False), self._of(greedy, True)
        w = self.config.prior_weight
        rates: list[float] = []
        for j in range(depth):
            above = rates[-1] if rates else self.config.prior_rate
            if widths is None and tree.rounds(j) > 0:
                above = tree.rate(j, above, w)
            rates.append(chain.rate(j, above, w))
        return rates if widths is None else [tree.rate(j, rates[j], w) for j in range(depth)]

    def reach(self, greedy: bool, depth: int) -> list[float]:
        """P(at least d candidates of a chain accepted), d = 1 .. depth."""
        out, p = [], 1.0
        for a in self.rates(greedy, depth):
            p *= a
            out.append(p)
        return out

    def seen_rounds(self, greedy: bool) -> int:
        return self._seen.get(greedy, 0)


def expected_tokens(rates: list[float], depth: int) -> float:
    """E[tokens emitted by a round of this depth] = 1 + sum_j prod_{m<=j} alpha[m] (recovered/bonus included)."""
    e, p = 1.0, 1.0
    for j in range(depth):
        p *= rates[j]
        e += p
    return e
