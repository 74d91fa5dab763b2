"""One exploration mechanism (stdlib only): how often to run, for a step or a burst, something not in use so
that its measurement stays current, and how much better an alternative must be to take over.

Used by the adaptive policy (the step sizes of plans it is not running) and by the pipelining switch (the mode
it is not running). An exploration that loses ``loss`` chosen steps is run every ``loss / explore_budget`` steps,
so exploring costs ~``explore_budget`` of the time when the prediction is right, between ``explore_min`` and
``explore_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.adaptive.config import AdaptiveConfig


@dataclass(frozen=True)
class Explorer:
    config: AdaptiveConfig

    def interval(self, loss: float, measured: bool = True, steps: int = 1) -> float:
        """Steps between explorations that each lose ``loss`` chosen steps and run ``steps`` steps (a burst): at
        least ``explore_min`` chosen steps per exploring one, except for a thing never measured, explored as soon
        as the budget allows."""
        c = self.config
        low = c.explore_min * steps if measured else 0
        return min(c.explore_every, max(low, loss / c.explore_budget))

    def beats(self, new: float, old: float) -> bool:
        """Whether ``new`` (a rate: more is better) wins over ``old`` by the hysteresis."""
        return new > old * (1 + self.config.hysteresis)
