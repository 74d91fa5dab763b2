"""Per-position acceptance estimates for the adaptive speculation policy (stdlib only).

``alpha[j]`` is the chance that the candidate at depth j + 1 is accepted given that the ones above it were
(a chain's per-position rate): a round that accepted ``a`` of ``d`` candidates tried positions 0 .. min(a, d - 1)
and accepted positions 0 .. a - 1. Then E[tokens of a round of depth k] = 1 + sum_{j<k} prod_{m<=j} alpha[m].

Each request keeps exponentially weighted counts of its own rounds, shrunk towards the engine-wide rates of
its sampling regime (greedy and sampled accept differently), which are the prior of a new request. Trees keep
their own counts (a level with w siblings accepts more often than a chain's single candidate).
"""

from __future__ import annotations

import math
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


_MIN_LIFE_ROUNDS = 4  # drafting rounds before a request's rate says anything of the spread between requests
_MIN_FINISHED = 4.0  # finished requests (decayed) before they, not the running ones, measure the spread
_MIN_WEIGHT = 2.0  # the least the engine's rates are worth to a request, however far apart the requests
# An empirical-Bayes weight over this is a spread too small to measure: the weight is infinite (``prior_weight``).
_ALIKE_WEIGHT = 32.0
# ... and before two requests of a regime have shown how far apart they are: 2 (the weight before this was learned)
# kept the first requests at batch 1 reacting to every miss (in-process, T = 0.8: 2.5 tokens a step over the first
# 8 requests, 4.2 once the weight was learned); 8 scored within 0.01 of the best weight on every recorded run.
_UNKNOWN_SPREAD_WEIGHT = 8.0


@dataclass
class _Spread:
    """Exponentially weighted moments of requests' first-position rates (one per request)."""

    decay: float = 0.95  # ~20 requests
    weight: float = 0.0
    mean: float = 0.0
    mean_sq: float = 0.0
    inv_rounds: float = 0.0  # mean of 1 / rounds: each rate's binomial noise is mu (1 - mu) / rounds

    def add(self, rate: float, rounds: int) -> None:
        self.weight = self.decay * self.weight + 1.0
        a = 1.0 / self.weight
        self.mean += a * (rate - self.mean)
        self.mean_sq += a * (rate * rate - self.mean_sq)
        self.inv_rounds += a * (1.0 / rounds - self.inv_rounds)

    def prior_weight(self) -> float:
        if self.weight < 2.0:
            return _UNKNOWN_SPREAD_WEIGHT
        mu = self.mean
        noise = mu * (1.0 - mu) * self.inv_rounds
        spread = self.mean_sq - mu * mu - noise
        if spread <= mu * (1.0 - mu) / (_ALIKE_WEIGHT + 1.0):  # no measurable spread (or none): the engine's rates
            return math.inf
        return max(_MIN_WEIGHT, mu * (1.0 - mu) / spread - 1.0)


@dataclass
class AcceptanceTracker:
    request_decay: float = 0.8  # a request's memory: ~5 rounds
    request_idle_decay: float = 0.93  # ... of a depth it does not reach: ~14 rounds
    engine_decay: float = 0.995  # the engine's: ~200 rounds
    # ... and of a depth its rounds do not reach: ~100 rounds. Aged only when tried, the few rounds that reach a
    # deep position decide it for good: at batch 1, T = 0.8 (built-in pair) the first request's 8 rounds at depth
    # 8 left positions 7 and 8 at 0.42 and 0.28 (the others ~0.88), the policy chose depth 5 from then on, and
    # nothing ever tried them again. Aged, they drift back to the rate above them and are tried once more.
    engine_idle_decay: float = 0.99
    prior_weight: float = 2.0  # how many rounds of evidence DEFAULT_RATE is worth to the engine's rates
    # ... and how many the engine's rates are worth to a request's own: None learns it from how far apart the
    # requests' first-position rates are (``request_weight``); a number fixes it.
    request_prior_weight: float | None = None
    _engine: dict[tuple[bool, bool], PositionCounts] = field(default_factory=dict)  # (greedy, tree) -> counts
    _requests: dict[tuple[int, bool], PositionCounts] = field(default_factory=dict)  # (seq_id, tree) -> counts
    _seen: dict[bool, int] = field(default_factory=dict)  # greedy -> rounds observed (chains and trees), undecayed
    # seq_id -> (greedy, first candidates accepted, rounds that drafted): a request's whole life, undecayed
    _life: dict[int, tuple[bool, int, int]] = field(default_factory=dict)
    _finished: dict[bool, _Spread] = field(default_factory=dict)  # greedy -> finished requests' first-position rates
    _weight: dict[bool, float] = field(default_factory=dict)  # greedy -> request_weight, until the next round

    def _engine_counts(self, greedy: bool, tree: bool) -> PositionCounts:
        c = self._engine.get((greedy, tree))
        if c is None:
            c = self._engine[(greedy, tree)] = PositionCounts(self.engine_decay, self.engine_idle_decay)
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
        _, accepted, rounds = self._life.get(seq_id, (greedy, 0, 0))
        self._life[seq_id] = (greedy, accepted + (num_accepted > 0), rounds + 1)
        self._weight.pop(greedy, None)
        self._engine_counts(greedy, tree).observe(depth, num_accepted)
        counts = self._requests.get((seq_id, tree))
        if counts is None:
            counts = self._requests[(seq_id, tree)] = PositionCounts(self.request_decay, self.request_idle_decay)
        counts.observe(depth, num_accepted)

    def forget(self, seq_id: int) -> None:
        self._requests.pop((seq_id, False), None)
        self._requests.pop((seq_id, True), None)
        life = self._life.pop(seq_id, None)
        if life is not None and life[2] >= _MIN_LIFE_ROUNDS:
            greedy, accepted, rounds = life
            self._finished.setdefault(greedy, _Spread()).add(accepted / rounds, rounds)
            self._weight.pop(greedy, None)

    def request_weight(self, greedy: bool) -> float:
        """Rounds of evidence the engine's rates are worth to a request of this regime: how alike its requests are.

        Empirical Bayes on the first position: the requests' rates scatter by their real spread tau^2 plus each
        one's binomial noise, so tau^2 = var(rate_i) - mean(mu (1 - mu) / rounds_i), and a Beta prior of that
        spread is worth mu (1 - mu) / tau^2 - 1 rounds, at least 2. From the last ~20 finished requests (with at
        least 4 drafting rounds each), or the running ones while fewer than 4 have finished; 8 while neither has two
        requests.

        Over 32 (a spread too small to measure): infinite, every request of the regime planned from the engine's
        rates. A request remembers ~5 rounds (``request_decay``), so past 32 its own rounds were under a seventh of
        its estimate and moved its plan by their noise only: on the built-in pair at batch 32 (greedy, in lockstep
        with a fixed chain of 4; benchmarks/results/adaptive-2026-12-04c/) the engine's rates ran 0.96-0.97x
        the chain where weight 32 ran 0.93-0.95x in the same runs, and 256 (the estimate itself, ~59) 0.96x
        against 0.95x.

        Measured (fixed K = 8, every round scored): on the built-in pair the requests are alike (greedy: this
        estimate ~59, T = 0.8 ~440; SmolLM2 with its draft ~18), and the log loss of the per-position predictions
        was 0.3397, 0.3811, 0.5967 at a weight of 2 against 0.3216, 0.3515, 0.5847 at 16: at 2 one miss made a
        greedy request that accepted ~90 % look like a 0.6 draft and put it on chains of 1-2 for several rounds.
        Where requests really differ (a code prompt beside chat) the spread is large and a request's own rounds
        decide."""
        if self.request_prior_weight is not None:
            return self.request_prior_weight
        w = self._weight.get(greedy)
        if w is None:
            spread = self._finished.get(greedy)
            if spread is None or spread.weight < _MIN_FINISHED:
                spread = _Spread(decay=1.0)
                for g, accepted, rounds in self._life.values():
                    if g == greedy and rounds >= _MIN_LIFE_ROUNDS:
                        spread.add(accepted / rounds, rounds)
            w = self._weight[greedy] = spread.prior_weight()
        return w

    def engine_rates(self, greedy: bool, depth: int, widths: tuple[int, ...] | None = None) -> list[float]:
        """Engine-wide rates for a regime: chains, or a tree with ``widths`` siblings per level (its prior: the
        chain's rate at that level. Siblings would accept 1 - (1 - alpha)^w if they were independent, but they
        are not (at T=0 they are the draft's next-best tokens; at T>0 draws from the same q), and a prior that
        promises the gain picks an unmeasured tree; the tree wins once its own rounds show the gain)."""
        chain = self._engine_counts(greedy, False)
        tree = self._engine_counts(greedy, True)
        # A position's prior is the rate of the one above it (DEFAULT_RATE at the first): a depth the policy has
        # not tried yet looks like the deepest one it has measured. A fixed prior below the measured rates
        # would keep a policy that stopped at depth d from ever trying d + 1 (its rounds never reach it), and
        # one above them would keep it too deep. For the chains' own prices, a position no chain round has tried
        # but tree rounds have takes the tree rounds' rate there (``informed``; the tree's prior is the chain's from
        # chain rounds alone). A level of w siblings accepts at least as often as one candidate, so this errs
        # towards trying the chain, whose rounds then measure it; DEFAULT_RATE instead kept a policy whose only
        # rounds of a regime were the configured tree's (its pinned first rounds) from ever running chains: at
        # batch 1, T = 0.8, built-in pair, tree [2, 1 x 7], half the fresh engines decoded plainly for ~95 % of
        # their rounds (the chains priced at 0.7 a position, really ~0.8).
        informed = widths is None
        rates: list[float] = []
        for j in range(depth):
            above = rates[-1] if rates else DEFAULT_RATE
            if informed and tree.rounds(j) > 0:
                above = tree.rate(j, above, self.prior_weight)
            rates.append(chain.rate(j, above, self.prior_weight))
        if informed:
            return rates
        return [tree.rate(j, rates[j], self.prior_weight) for j in range(depth)]

    def rates(self, seq_id: int, greedy: bool, depth: int, widths: tuple[int, ...] | None = None,
              prior: list[float] | None = None) -> list[float]:
        """A request's per-position rates: its own rounds, shrunk towards the engine's (``prior``: those rates,
        when the caller already has them)."""
        if prior is None or len(prior) < depth:
            prior = self.engine_rates(greedy, depth, widths)
        own = self._requests.get((seq_id, widths is not None))
        weight = self.request_weight(greedy)
        if own is None or math.isinf(weight):
            return prior[:depth]
        return [own.rate(j, prior[j], weight) for j in range(depth)]

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
