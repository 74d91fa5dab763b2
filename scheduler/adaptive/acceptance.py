"""Per-position acceptance estimates (stdlib only).

``alpha[j]``: the chance the candidate at depth j + 1 is accepted given the ones above it were. A round that
accepted ``a`` of ``d`` tried positions 0 .. min(a, d - 1). E[tokens of a depth-k round] = 1 + sum_j prod alpha.
Each request's own rounds are shrunk towards the engine-wide rates of its regime (greedy or sampled), with a
weight learned from how far apart the requests are (empirical Bayes: where they are too alike to tell apart,
every request is planned from the engine's rates); trees keep their own counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.adaptive.config import AdaptiveConfig


@dataclass
class PositionCounts:
    """Exponentially weighted (accepted, tried) per position; positions not reached age at ``idle_decay``, so a
    depth the request stopped reaching drifts back to its prior instead of keeping the miss that ended it."""

    decay: float
    idle_decay: float = 1.0
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
class _Spread:
    """Weighted moments of requests' first-position rates: their real spread is the variance less binomial noise."""

    decay: float
    weight: float = 0.0
    mean: float = 0.0
    mean_sq: float = 0.0
    inv_rounds: float = 0.0

    def add(self, rate: float, rounds: int) -> None:
        self.weight = self.decay * self.weight + 1.0
        a = 1.0 / self.weight
        self.mean += a * (rate - self.mean)
        self.mean_sq += a * (rate * rate - self.mean_sq)
        self.inv_rounds += a * (1.0 / rounds - self.inv_rounds)

    def prior_weight(self, cfg: AdaptiveConfig) -> float:
        """Rounds a Beta prior of this spread is worth: mu (1 - mu) / tau^2 - 1."""
        if self.weight < 2.0:
            return cfg.unknown_spread_weight
        mu = self.mean
        spread = self.mean_sq - mu * mu - mu * (1.0 - mu) * self.inv_rounds
        if spread <= mu * (1.0 - mu) / (cfg.alike_weight + 1.0):
            return math.inf
        return max(cfg.prior_weight, mu * (1.0 - mu) / spread - 1.0)


@dataclass
class AcceptanceTracker:
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    _engine: dict[tuple[bool, bool], PositionCounts] = field(default_factory=dict)  # (greedy, tree) -> counts
    _requests: dict[tuple[int, bool], PositionCounts] = field(default_factory=dict)  # (seq_id, tree) -> counts
    _seen: dict[bool, int] = field(default_factory=dict)  # greedy -> speculative rounds observed
    _life: dict[int, tuple[bool, int, int]] = field(default_factory=dict)  # seq_id -> (greedy, firsts accepted, rounds)
    _finished: dict[bool, _Spread] = field(default_factory=dict)
    _weight: dict[bool, float] = field(default_factory=dict)  # cached request_weight until the next round

    def _engine_counts(self, greedy: bool, tree: bool) -> PositionCounts:
        key = (greedy, tree)
        if key not in self._engine:
            self._engine[key] = PositionCounts(self.config.engine_decay, self.config.engine_idle_decay)
        return self._engine[key]

    def observe(self, seq_id: int, greedy: bool, tree: bool, depth: int, num_accepted: int) -> None:
        if depth <= 0:  # a plain round: nothing tried, but the request's evidence ages
            for key in ((seq_id, False), (seq_id, True)):
                if key in self._requests:
                    self._requests[key].observe(0, 0)
            return
        self._seen[greedy] = self._seen.get(greedy, 0) + 1
        _, accepted, rounds = self._life.get(seq_id, (greedy, 0, 0))
        self._life[seq_id] = (greedy, accepted + (num_accepted > 0), rounds + 1)
        self._weight.pop(greedy, None)
        self._engine_counts(greedy, tree).observe(depth, num_accepted)
        key = (seq_id, tree)
        if key not in self._requests:
            self._requests[key] = PositionCounts(self.config.request_decay, self.config.request_idle_decay)
        self._requests[key].observe(depth, num_accepted)

    def forget(self, seq_id: int) -> None:
        self._requests.pop((seq_id, False), None)
        self._requests.pop((seq_id, True), None)
        life = self._life.pop(seq_id, None)
        if life is not None and life[2] >= self.config.spread_rounds:
            greedy, accepted, rounds = life
            self._finished.setdefault(greedy, _Spread(self.config.spread_decay)).add(accepted / rounds, rounds)
            self._weight.pop(greedy, None)

    def request_weight(self, greedy: bool) -> float:
        """Rounds of evidence the engine's rates are worth to a request: from the finished requests' spread, or
        the running ones' while too few have finished; infinite where requests are too alike to tell apart."""
        w = self._weight.get(greedy)
        if w is None:
            spread = self._finished.get(greedy)
            if spread is None or spread.weight < self.config.spread_rounds:
                spread = _Spread(1.0)
                for g, accepted, rounds in self._life.values():
                    if g == greedy and rounds >= self.config.spread_rounds:
                        spread.add(accepted / rounds, rounds)
            w = self._weight[greedy] = spread.prior_weight(self.config)
        return w

    def engine_rates(self, greedy: bool, depth: int, widths: tuple[int, ...] | None = None) -> list[float]:
        """Engine-wide rates: chains, or a tree with ``widths`` siblings per level. A position's prior is the rate
        above it (an untried depth looks like the deepest measured one); a chain position only tree rounds tried
        takes their rate; a tree level's prior is the chain's (a tree wins once its own rounds show the gain)."""
        chain, tree = self._engine_counts(greedy, False), self._engine_counts(greedy, True)
        w = self.config.prior_weight
        rates: list[float] = []
        for j in range(depth):
            above = rates[-1] if rates else self.config.prior_rate
            if widths is None and tree.rounds(j) > 0:
                above = tree.rate(j, above, w)
            rates.append(chain.rate(j, above, w))
        return rates if widths is None else [tree.rate(j, rates[j], w) for j in range(depth)]

    def rates(self, seq_id: int, greedy: bool, depth: int, widths: tuple[int, ...] | None = None,
              prior: list[float] | None = None) -> list[float]:
        """A request's per-position rates: its own rounds shrunk towards the engine's (``prior``, if known)."""
        if prior is None or len(prior) < depth:
            prior = self.engine_rates(greedy, depth, widths)
        own = self._requests.get((seq_id, widths is not None))
        weight = self.request_weight(greedy)
        if own is None or math.isinf(weight):
            return prior[:depth]
        return [own.rate(j, prior[j], weight) for j in range(depth)]

    def reach(self, greedy: bool, depth: int) -> list[float]:
        """P(at least d candidates of a chain accepted), d = 1 .. depth, from the engine's rates."""
        out, p = [], 1.0
        for a in self.engine_rates(greedy, depth):
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
