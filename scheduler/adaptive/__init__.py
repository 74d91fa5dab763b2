"""The adaptive speculation policy (docs/adaptive.md): config, acceptance, costs, planner, exploration, policy."""

from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.policy import AdaptivePolicy

__all__ = ["AdaptiveConfig", "AdaptivePolicy"]
