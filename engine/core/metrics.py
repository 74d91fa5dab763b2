"""Aggregate speculative-decoding statistics (vLLM's conventions: acceptance length counts the bonus token)."""

from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields

from scheduler.adaptive.costs import StepTiming
from scheduler.prefix_cache import PrefixCacheStats
from scheduler.request import RoundStats

# The prefix cache's counters are the scheduler's (it owns the lookups); named here with the engine's other stats.
__all__ = ["PrefixCacheStats", "SpecDecodingStats", "StepClock", "StepTimes", "reset"]


def reset(stats: object) -> None:
    """Every field of a stats dataclass back to its default, in place (others hold a reference to it)."""
    for f in fields(stats):
        setattr(stats, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)


def _depth(key: str) -> int:
    """The depth of a ``chosen_depths`` key: "4" -> 4, "tree:2x1x1" -> 3."""
    return len(key.removeprefix("tree:").split("x")) if key.startswith("tree:") else int(key)


@dataclass
class SourceStats:
    """Rounds one drafting source proposed in (n-gram, suffix, the draft model), and what they got accepted."""

    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    def as_dict(self) -> dict:
        n = self.num_rounds
        return {"num_rounds": n, "num_drafted": self.num_drafted, "num_accepted": self.num_accepted,
                "mean_acceptance_length": round(1 + self.num_accepted / n, 4) if n else 0.0}


@dataclass
class SpecDecodingStats(RoundStats):
    """Aggregate over every request: the same round definition and fields as a request's own statistics, plus
    the distribution of the speculation policy's choices (rounds per depth; "tree:2x1" for a tree shape)."""

    chosen_depths: dict[str, int] = field(default_factory=dict)
    by_source: dict[str, SourceStats] = field(default_factory=dict)  # who proposed the rounds (drafters record it)

    def record_source(self, source: str, drafted: int, accepted: int) -> None:
        s = self.by_source.setdefault(source, SourceStats())
        s.num_rounds += 1
        s.num_drafted += drafted
        s.num_accepted += accepted

    def record_round(self, drafted: int, accepted: int, emitted: int, bonus: bool,
                     branching: tuple[int, ...] = ()) -> None:
        super().record_round(drafted, accepted, emitted, bonus)
        self.record_choice(branching)

    def record_choice(self, branching: tuple[int, ...]) -> None:
        key = f"tree:{'x'.join(map(str, branching))}" if any(w > 1 for w in branching) else str(len(branching))
        self.chosen_depths[key] = self.chosen_depths.get(key, 0) + 1

    @property
    def mean_chosen_depth(self) -> float:
        n = sum(self.chosen_depths.values())
        return sum(_depth(k) * v for k, v in self.chosen_depths.items()) / n if n else 0.0

    def as_dict(self) -> dict:
        order = sorted(self.chosen_depths, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        return {**super().as_dict(), "chosen_depths": {k: self.chosen_depths[k] for k in order},
                "mean_chosen_depth": round(self.mean_chosen_depth, 4),
                **({"by_source": {k: v.as_dict() for k, v in self.by_source.items()}} if self.by_source else {})}


@dataclass
class StepTimes:
    """Where a step's wall time goes, for the cycle-cost model: time per token = (draft + verify + commit) / tokens.

    *_wall_s are seen by the controller (including messaging); draft_s / verify_s are the workers' own times, so
    wall minus worker time is messaging and (de)serialisation. A pipelined pre-draft overlaps verification and
    shows up in collect_s only when the target finished first.
    """

    steps: int = 0
    schedule_s: float = 0.0
    draft_wall_s: float = 0.0  # drafting the controller waited for (every draft with pipelining off)
    draft_s: float = 0.0  # draft worker time of those calls
    verify_wall_s: float = 0.0
    verify_s: float = 0.0  # target worker time
    commit_s: float = 0.0  # controller: counters, stop checks, block trims, emitting
    collect_s: float = 0.0  # the drafter's commit (pipelining: waiting for the pre-draft, and matching)

    def clock(self) -> StepClock:
        """Times one step: each ``lap`` adds the time since the previous one to a field."""
        self.steps += 1
        return StepClock(self, time.perf_counter())

    def timing_since(self, before: StepTimes, draft_prefill: bool, forward_s: list[float] | None) -> StepTiming:
        """The step timed since ``before``, split as the cost model prices it. ``forward_s``: the draft worker's
        seconds of each forward (None when pipelined: the worker's share is hidden)."""
        return StepTiming(
            verify_s=self.verify_wall_s - before.verify_wall_s,
            draft_s=self.draft_wall_s - before.draft_wall_s + self.collect_s - before.collect_s,
            state_s=self.schedule_s - before.schedule_s + self.commit_s - before.commit_s,
            draft_prefill=draft_prefill, draft_forward_s=forward_s)

    @property
    def messaging_s(self) -> float:
        return max(0.0, self.draft_wall_s - self.draft_s) + max(0.0, self.verify_wall_s - self.verify_s)

    def as_dict(self) -> dict:
        keys = ("steps", "schedule_s", "draft_wall_s", "draft_s", "verify_wall_s", "verify_s", "commit_s",
                "collect_s")
        out = {k: round(getattr(self, k), 4) for k in keys}
        out["messaging_s"] = round(self.messaging_s, 4)
        return out


@dataclass
class StepClock:
    times: StepTimes
    last: float

    def lap(self, name: str, **worker_s: float) -> None:
        now = time.perf_counter()
        t = self.times
        setattr(t, name, getattr(t, name) + now - self.last)
        for k, v in worker_s.items():  # the workers' own time of the part just timed
            setattr(t, k, getattr(t, k) + v)
        self.last = now
