"""One exploration mechanism, for the policy's plan sizes and the pipelining switch's modes (stdlib only): how
often to run something not in use so its measurement stays current, and how much an alternative must win by."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.adaptive.config import AdaptiveConfig


@dataclass(frozen=True)
class Explorer:
    config: AdaptiveConfig

    def interval(self, loss: float, measured: bool = True, steps: int = 1) -> float:
        """Steps between explorations that each lose ``loss`` chosen steps (``explore_budget`` of the time) and
        run ``steps`` steps: at least ``explore_min`` per exploring step, unless never measured."""
        c = self.config
        low = c.explore_min * steps if measured else 0
        return min(c.explore_every, max(low, loss / c.explore_budget))

    def beats(self, new: float, old: float) -> bool:
        """Whether ``new`` (a rate: more is better) wins over ``old`` by the hysteresis."""
        return new > old * (1 + self.config.hysteresis)
