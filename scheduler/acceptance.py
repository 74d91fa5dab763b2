"""Per-position acceptance estimates for the adaptive speculation policy (stdlib only).

``alpha[j]`` is the chance that the candidate at depth j + 1 is accepted given that the ones above it were
(a chain's per-position rate): a round that accepted ``a`` of ``d`` candidates tried positions 0 .. min(a, d - 1)
and accepted positions 0 .. a - 1. Then E[tokens of a round of depth k] = 1 + sum_{j<k} prod_{m<=j} alpha[m].

Each request keeps exponentially weighted counts of its own rounds, shrunk towards the engine-wide rates of
its sampling regime (greedy and sampled accept differently), which are the prior of a new request. Trees keep
their own counts (a level with w siblings accepts more often than a chain's single candidate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_RATE = 0.7  # before anything is measured (the pipelined drafter's prior too)


@dataclass
class PositionCounts:
    """Exponentially weighted (accepted, tried) per position."""

    decay: float  # weight kept by the old counts each time a position is tried
    # ... and each round that does not reach it: a depth the request stopped reaching drifts back to the prior
    # instead of keeping the miss that made the policy stop short of it. Aged only when tried, one early miss at
    # depth 3 could keep a greedy request (90 % acceptance per position) on chains of 2 to its end. Slower than
    # ``decay``: aged as fast, a deep position's few reached rounds made its estimate noisy, and the depths flapped.
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
            else:  # not reached this round: its evidence ages all the same, more slowly (see ``idle_decay``)
                self.accepted[j] *= self.idle_decay
                self.tried[j] *= self.idle_decay

    def rate(self, j: int, prior: float, prior_weight: float) -> float:
        a, t = (self.accepted[j], self.tried[j]) if j < len(self.tried) else (0.0, 0.0)
        return (a + prior_weight * prior) / (t + prior_weight)

    def rounds(self, j: int = 0) -> float:
        return self.tried[j] if j < len(self.tried) else 0.0


@dataclass
class AcceptanceTracker:
    request_decay: float = 0.8  # a request's memory: ~5 rounds
    request_idle_decay: float = 0.93  # ... of a depth it does not reach: ~14 rounds
    engine_decay: float = 0.995  # the engine's: ~200 rounds
    prior_weight: float = 2.0  # how many rounds of evidence the prior is worth
    _engine: dict[tuple[bool, bool], PositionCounts] = field(default_factory=dict)  # (greedy, tree) -> counts
    _requests: dict[tuple[int, bool], PositionCounts] = field(default_factory=dict)  # (seq_id, tree) -> counts
    _seen: dict[bool, int] = field(default_factory=dict)  # greedy -> rounds observed (chains and trees), undecayed

    def _counts(self, table: dict, key: tuple, decay: float) -> PositionCounts:
        c = table.get(key)
        if c is None:
            c = table[key] = PositionCounts(decay)
        return c

    def observe(self, seq_id: int, greedy: bool, tree: bool, depth: int, num_accepted: int) -> None:
        if depth <= 0:
            # A plain round: nothing tried, but the request's evidence ages. A greedy request that two misses put
            # on plain decode otherwise stayed there until an exploration step (26 plain steps in a row at
            # batch 1, served): its estimates only moved when it speculated.
            for key in ((seq_id, False), (seq_id, True)):
                counts = self._requests.get(key)
                if counts is not None:
                    counts.observe(0, 0)
            return
        self._seen[greedy] = self._seen.get(greedy, 0) + 1
        self._counts(self._engine, (greedy, tree), self.engine_decay).observe(depth, num_accepted)
        counts = self._requests.get((seq_id, tree))
        if counts is None:
            counts = self._requests[(seq_id, tree)] = PositionCounts(self.request_decay, self.request_idle_decay)
        counts.observe(depth, num_accepted)

    def forget(self, seq_id: int) -> None:
        self._requests.pop((seq_id, False), None)
        self._requests.pop((seq_id, True), None)

    def engine_rates(self, greedy: bool, depth: int, widths: tuple[int, ...] | None = None) -> list[float]:
        """Engine-wide rates for a regime: chains, or a tree with ``widths`` siblings per level (its prior: the
        chain's rate at that level. Siblings would accept 1 - (1 - alpha)^w if they were independent, but they
        are not (at T=0 they are the draft's next-best tokens; at T>0 draws from the same q), and a prior that
        promises the gain picks an unmeasured tree; the tree wins once its own rounds show the gain)."""
        chain = self._counts(self._engine, (greedy, False), self.engine_decay)
        # A position's prior is the rate of the one above it (DEFAULT_RATE at the first): a depth the policy has
        # not tried yet looks like the deepest one it has measured. A fixed prior below the measured rates
        # would keep a policy that stopped at depth d from ever trying d + 1 (its rounds never reach it), and
        # one above them would keep it too deep.
        rates: list[float] = []
        for j in range(depth):
            rates.append(chain.rate(j, rates[-1] if rates else DEFAULT_RATE, self.prior_weight))
        if widths is None:
            return rates
        tree = self._counts(self._engine, (greedy, True), self.engine_decay)
        return [tree.rate(j, rates[j], self.prior_weight) for j in range(depth)]

    def rates(self, seq_id: int, greedy: bool, depth: int, widths: tuple[int, ...] | None = None,
              prior: list[float] | None = None) -> list[float]:
        """A request's per-position rates: its own rounds, shrunk towards the engine's (``prior``: those rates,
        when the caller already has them)."""
        if prior is None or len(prior) < depth:
            prior = self.engine_rates(greedy, depth, widths)
        own = self._requests.get((seq_id, widths is not None))
        if own is None:
            return prior[:depth]
        return [own.rate(j, prior[j], self.prior_weight) for j in range(depth)]

    def seen_rounds(self, greedy: bool) -> int:
        """Rounds of a regime observed so far, chains and trees, not decayed (the decayed per-position counts read
        a little under n after exactly n rounds)."""
        return self._seen.get(greedy, 0)


def expected_tokens(rates: list[float], depth: int) -> float:
    """E[tokens emitted by a round of this depth] = 1 + sum_j prod_{m<=j} alpha[m] (the bonus/recovered token
    included)."""
    e, p = 1.0, 1.0
    for j in range(depth):
        p *= rates[j]
        e += p
    return e
