"""Aggregate speculative-decoding statistics (vLLM's conventions: acceptance length counts the bonus token)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        while len(self.accepted_per_position) < accepted:
            self.accepted_per_position.append(0)
        for d in range(accepted):
            self.accepted_per_position[d] += 1

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
