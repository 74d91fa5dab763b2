"""Aggregate speculative-decoding statistics (vLLM's conventions: acceptance length counts the bonus token)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import count_accepted_positions


@dataclass
class SpecDecodingStats:
    num_rounds: int = 0  # verify passes that carried candidates
    num_plain_rounds: int = 0  # decode rounds with no candidates (no speculation, or nothing left to draft)
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # tokens produced by speculative rounds (accepted + recovered/bonus)
    accepted_per_position: list[int] = field(default_factory=list)

    def record_round(self, drafted_tokens: int, accepted: int, emitted: int, drafted: bool = True) -> None:
        if not drafted:
            self.num_plain_rounds += 1
            return
        self.num_rounds += 1
        self.num_drafted += drafted_tokens
        self.num_accepted += accepted
        self.num_emitted += emitted
        count_accepted_positions(self.accepted_per_position, accepted)

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.num_rounds for a in self.accepted_per_position] if self.num_rounds else []

    def as_dict(self) -> dict:
        return {
            "rounds": self.num_rounds,
            "plain_decode_rounds": self.num_plain_rounds,
            "drafted_tokens": self.num_drafted,
            "accepted_tokens": self.num_accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_per_position": [round(a, 4) for a in self.acceptance_per_position],
        }


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
    commit_s: float = 0.0  # controller: counters, stop checks, block trims
    collect_s: float = 0.0  # pipelining: waiting for the pre-draft after verification, and matching

    def record(self, **parts: float) -> None:
        self.steps += 1
        for k, v in parts.items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def messaging_s(self) -> float:
        return max(0.0, self.draft_wall_s - self.draft_s) + max(0.0, self.verify_wall_s - self.verify_s)

    def as_dict(self) -> dict:
        keys = ("steps", "schedule_s", "draft_wall_s", "draft_s", "verify_wall_s", "verify_s", "commit_s",
                "collect_s")
        out = {k: round(getattr(self, k), 4) for k in keys}
        out["messaging_s"] = round(self.messaging_s, 4)
        return out
