"""What ``/health`` reports, and how often the server may rebuild a failed engine.

- ``Health``: "ok" / "degraded" (serving; a dead worker is being replaced inside the engine) answer 200,
  "restarting" / "down" (no engine to serve with) answer 503.
- ``RestartBudget``: at most ``max_restarts`` engine rebuilds within ``window_s``; the first at once, then after
  ``backoff_s``, doubling, so a fault that keeps coming back is not retried in a tight loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Health:
    """What ``/health`` says: "ok" and "degraded" (serving; ``restoring`` names the worker roles being replaced)
    answer 200, "restarting" and "down" (no engine to serve with; ``reason`` says why) answer 503."""

    status: str  # "ok" | "degraded" | "restarting" | "down"
    reason: str | None = None
    restoring: tuple[str, ...] = ()

    @property
    def serving(self) -> bool:
        return self.status in ("ok", "degraded")


def read_restoring(engine: Any) -> tuple[str, ...]:
    """Worker roles the engine is restoring now (recovery.py), read from any thread; () without recovery."""
    recovery = getattr(engine, "recovery", None)
    return tuple(getattr(recovery, "restoring", ())) if recovery is not None else ()


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, backoff_s: float) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self._times: list[float] = []  # time.monotonic() of each restart within the window

    def take(self) -> float | None:
        """Count one more restart: the seconds to wait before it, or None when the budget is spent."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            return None
        delay = self.backoff_s * 2 ** (len(self._times) - 1) if self._times else 0.0
        self._times.append(now)
        return delay

    def describe(self) -> str:
        return (f"the server restarted it {len(self._times)} time(s) within {self.window_s:g} s and gives up "
                f"(max_engine_restarts={self.max_restarts})")
