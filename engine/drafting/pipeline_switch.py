"""Pipelining where it pays: each step of a pipelined engine runs pipelined or sequential, whichever is measured
cheaper per emitted token in the step's regime (sampled or greedy, batch-size bucket).

Pipelining hides the draft behind verification but costs something: the pre-draft competes with the target (a
core, memory bandwidth, the interpreter lock), and at batch b a step skips its re-draft only if all b rounds hit.
A *sequential* step pre-drafts nothing, so the next one drafts every round from its real prefix. Outputs do not
depend on the mode: a pre-drafted tree is the tree a re-draft would propose.

Cost per token: decayed sums of steady steps' seconds and tokens per regime and mode (a step is steady when the
previous one ran the same mode; steps with prompt chunks are not counted). First ``switch_samples`` steady steps
sequential (it cannot cost a core), then pipelined ones, cut short once one costs ``switch_give_up`` times a
sequential one; then the cheaper mode, switching only when the other wins by the hysteresis, with bursts of the
other mode spaced by the shared exploration budget (scheduler/adaptive/explore.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.costs import bucket
from scheduler.adaptive.explore import Explorer

PIPELINED, SEQUENTIAL = True, False
Regime = tuple[bool, int]  # (any sampled request, batch-size bucket)


def regime(sampled: bool, batch_size: int) -> Regime:
    return sampled, bucket(batch_size)


@dataclass
class _Cost:
    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


@dataclass
class _Regime:
    cost: dict[bool, _Cost] = field(default_factory=lambda: {PIPELINED: _Cost(), SEQUENTIAL: _Cost()})
    mode: bool = SEQUENTIAL
    since_explore: int = 0
    explore_left: int = 0
    switches: int = 0


@dataclass
class PipelineSwitch:
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    enabled: bool = True  # False: every step pipelined
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
        c, g = self.config, self._regimes.setdefault(key, _Regime())
        if g.explore_left > 0:
            g.explore_left -= 1
            return not g.mode
        seq, pipe = g.cost[SEQUENTIAL], g.cost[PIPELINED]
        if seq.samples < c.switch_samples:
            return SEQUENTIAL
        if pipe.samples < c.switch_samples and not (pipe.samples and pipe.per_token() > c.switch_give_up
                                                   * seq.per_token()):
            return PIPELINED
        g.since_explore += 1
        cur, other = g.cost[g.mode].per_token(), g.cost[not g.mode].per_token()
        loss = c.switch_burst * (other / cur - 1) if cur and other is not None else 0.0
        if g.since_explore >= Explorer(c).interval(loss, steps=c.switch_burst):
            g.since_explore, g.explore_left = 0, c.switch_burst - 1
            return not g.mode
        return g.mode

    def observe(self, key: Regime, mode: bool, steady: bool, seconds: float, tokens: int) -> None:
        """A finished step: counted if steady; then the regime's mode is re-chosen with the hysteresis."""
        if self.force is not None or not self.enabled or not steady or tokens <= 0:
            return
        c, g = self.config, self._regimes.setdefault(key, _Regime())
        own, other = g.cost[mode], g.cost[not mode]
        own.seconds, own.tokens = c.switch_keep * own.seconds + seconds, c.switch_keep * own.tokens + tokens
        own.samples += 1
        other.seconds, other.tokens = c.switch_age * other.seconds, c.switch_age * other.tokens
        cur, alt = g.cost[g.mode].per_token(), g.cost[not g.mode].per_token()
        if (cur and alt and g.cost[not g.mode].samples >= c.switch_samples
                and Explorer(c).beats(1 / alt, 1 / cur)):
            g.mode, g.since_explore, g.switches = not g.mode, 0, g.switches + 1

    def as_dict(self) -> dict:
        """Per regime: ms per emitted token of each mode, the chosen mode, how often it switched."""
        def ms(c: _Cost) -> float | None:
            v = c.per_token()
            return round(1e3 * v, 3) if v is not None else None

        return {f"{'sampled' if s else 'greedy'}@bucket{b}": {
            "pipelined_ms_per_token": ms(g.cost[PIPELINED]), "sequential_ms_per_token": ms(g.cost[SEQUENTIAL]),
            "mode": "pipelined" if g.mode else "sequential", "switches": g.switches}
            for (s, b), g in sorted(self._regimes.items())}
