"""Pipelining where it pays: each step of a pipelined engine runs pipelined or sequential, whichever is measured
cheaper per emitted token in the step's regime.

Pipelining hides the draft behind verification but costs something: the pre-draft competes with the target (a
core, memory bandwidth, the interpreter lock), and a miss re-drafts anyway — at batch b a step skips its re-draft
call only if all b rounds hit. Where that cost exceeds what hiding saves (measured: batch 8, and T > 0 on two
cores), the engine is better off sequential. Which one wins depends on the regime, so it is learned per regime:
(sampled or greedy, batch-size bucket 1, 2, 3-4, 5-8, ...).

A *sequential* step inside the pipelined drafter is one that pre-drafts nothing during verification: the next
step then finds no pre-drafted tree and drafts every round from its real prefix, then verifies — what
``SequentialDrafter`` does, with the same draft worker (in a thread, a local process with pinned cores, or a Ray
actor). Outputs do not depend on the mode: a pre-drafted tree is the tree a re-draft would propose.

Measurement: a step's wall time (from the draft call to the end of commit) and its emitted tokens, kept as
decayed sums per regime and mode (a mode's own samples decay its sums fast, the other mode's slowly, so the
estimate of a mode run only in exploration bursts is mostly its last bursts); the ratio is the cost per token.
Only *steady* steps count: a step whose previous step ran the same mode (the first pipelined step after a
sequential one has no pre-drafted tree yet, the first sequential one after a pipelined one still uses the
pre-drafted trees). Steps with prompt chunks are not counted (their time is mostly prefill).

Policy per regime: first ``min_samples`` steady steps sequential (the mode that cannot cost a core), then
pipelined ones, cut short once a steady pipelined step costs ``give_up`` times the sequential cost per token;
then the cheaper mode (sequential on a tie). A short burst of the other mode keeps its estimate fresh, every
``explore_every`` steps or more rarely, so that exploring a mode that costs r times the chosen one spends at most
``explore_budget`` of the time: ``explore_steps * (r - 1) / interval <= explore_budget``, but at least every
``explore_max`` steps (one slow burst during a load spike must not lock a mode out for long). The engine switches
only when the other mode is cheaper by ``margin`` (hysteresis, so near-equal modes do not flap). Each regime
learns for itself: the modes' ratio changes with the batch size (all of a batch must hit to skip a re-draft).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PIPELINED, SEQUENTIAL = True, False
Regime = tuple[bool, int]  # (any sampled request, batch-size bucket)


def regime(sampled: bool, batch_size: int) -> Regime:
    """Buckets 0: batch 1, 1: 2, 2: 3-4, 3: 5-8, 4: 9-16, ..."""
    return sampled, max(batch_size - 1, 0).bit_length()


@dataclass
class _Cost:
    """Decayed sums of step seconds and emitted tokens: their ratio is the cost per token."""

    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def add(self, seconds: float, tokens: int, keep: float) -> None:
        self.seconds = keep * self.seconds + seconds
        self.tokens = keep * self.tokens + tokens
        self.samples += 1

    def fade(self, keep: float) -> None:
        self.seconds *= keep
        self.tokens *= keep

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


@dataclass
class _Regime:
    cost: dict[bool, _Cost] = field(default_factory=lambda: {PIPELINED: _Cost(), SEQUENTIAL: _Cost()})
    mode: bool = SEQUENTIAL  # what it runs outside learning and exploration
    since_explore: int = 0
    explore_left: int = 0  # steps of the other mode still to run
    switches: int = 0


@dataclass
class PipelineSwitch:
    enabled: bool = True  # False: every step pipelined
    min_samples: int = 3  # steady steps of each mode before the first choice
    give_up: float = 1.3  # ... unless a pipelined one already costs this many times a sequential one
    explore_every: int = 32  # steps in the chosen mode between bursts of the other, at least
    explore_steps: int = 3  # a burst: one transition step, then measured ones
    explore_budget: float = 0.03  # the share of time exploring may cost
    explore_max: int = 128  # ... but at least this often
    margin: float = 0.05  # switch only when the other mode is this much cheaper per token
    keep: float = 0.8  # decay of a mode's sums per sample of it
    age: float = 0.97  # ... and per sample of the other mode: a rarely run mode's old steps fade meanwhile
    force: Callable[[int], bool] | None = None  # tests: the mode of step i (True = pipelined), overriding all
    _regimes: dict[Regime, _Regime] = field(default_factory=dict)
    _step: int = 0

    def choose(self, key: Regime) -> bool:
        """The mode of the step about to run (True: pre-draft the next round during verification)."""
        self._step += 1
        if self.force is not None:
            return bool(self.force(self._step - 1))
        if not self.enabled:
            return PIPELINED
        g = self._regime(key)
        if g.explore_left > 0:
            g.explore_left -= 1
            return not g.mode
        seq, pipe = g.cost[SEQUENTIAL], g.cost[PIPELINED]
        if seq.samples < self.min_samples:  # learn both before choosing, the safe one first
            return SEQUENTIAL
        if pipe.samples < self.min_samples and not (pipe.samples and pipe.per_token() > self.give_up
                                                    * seq.per_token()):
            return PIPELINED
        g.since_explore += 1
        if g.since_explore >= self._interval(g):
            g.since_explore = 0
            g.explore_left = self.explore_steps - 1
            return not g.mode
        return g.mode

    def observe(self, key: Regime, mode: bool, steady: bool, seconds: float, tokens: int) -> None:
        """A finished step: counted if steady; then the regime's mode is re-chosen with hysteresis."""
        if self.force is not None or not self.enabled or not steady or tokens <= 0:
            return
        g = self._regime(key)
        g.cost[mode].add(seconds, tokens, self.keep)
        g.cost[not mode].fade(self.age)
        cur, other = g.cost[g.mode].per_token(), g.cost[not g.mode].per_token()
        if (cur is not None and other is not None and g.cost[not g.mode].samples >= self.min_samples
                and other < cur * (1 - self.margin)):
            g.mode = not g.mode
            g.since_explore = 0
            g.switches += 1

    def _interval(self, g: _Regime) -> float:
        """Steps between exploration bursts: rarer the costlier the other mode is measured to be."""
        cur, other = g.cost[g.mode].per_token(), g.cost[not g.mode].per_token()
        if not cur or other is None:
            return self.explore_every
        # Capped: an estimate spoilt by one slow burst (a load spike) must not lock a mode out for long.
        return min(self.explore_max, max(self.explore_every, self.explore_steps * (other / cur - 1)
                                         / self.explore_budget))

    def _regime(self, key: Regime) -> _Regime:
        return self._regimes.setdefault(key, _Regime())

    def as_dict(self) -> dict:
        """Per regime: ms per emitted token of each mode, the chosen mode, how often it switched."""
        def ms(c: _Cost) -> float | None:
            v = c.per_token()
            return round(1e3 * v, 3) if v is not None else None

        return {f"{'sampled' if s else 'greedy'}@b{'1' if b == 0 else f'{2 ** (b - 1) + 1}-{2 ** b}'}": {
            "pipelined_ms_per_token": ms(g.cost[PIPELINED]), "sequential_ms_per_token": ms(g.cost[SEQUENTIAL]),
            "mode": "pipelined" if g.mode else "sequential", "switches": g.switches}
            for (s, b), g in sorted(self._regimes.items())}
