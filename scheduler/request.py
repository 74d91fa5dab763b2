"""Request state: one counter model per request (stdlib only).

``output_token_ids`` holds every token emitted so far. Each cache (target, draft) says how many of the
request's tokens it has committed KV for (``num_cached_target`` / ``num_cached_draft``: the *committed
length*; workers call it ``base_len``); everything past that is *in flight*: fed to the model next round.
A rejected candidate never enters ``output_token_ids``, so rejection is just not advancing a counter. Only the
scheduler moves the counters (``Scheduler.update_from_output``, preemption).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


def count_accepted_positions(counts: list[int], accepted: int) -> None:
    """counts[d] += 1 for every depth d < accepted (per-position acceptance, grown as needed)."""
    counts.extend([0] * (accepted - len(counts)))
    for d in range(accepted):
        counts[d] += 1


@dataclass
class RoundStats:
    """Counts over verified rounds, the one definition shared by per-request and aggregate statistics.

    A *round* is one verification of a request that carried candidates. A decode step without candidates
    (no speculation, or nothing left to draft) is a *plain round*, counted apart, so that the mean acceptance
    length (vLLM's convention: tokens per round, the recovered/bonus token included) is over speculative rounds.
    """

    num_rounds: int = 0
    num_plain_rounds: int = 0
    num_drafted: int = 0  # candidate tokens verified (tree nodes)
    num_accepted: int = 0
    num_emitted: int = 0  # tokens produced by rounds (accepted + recovered/bonus), before stop truncation
    num_bonus: int = 0  # rounds that ended with a bonus token (every candidate on a path accepted); the rest
    #                     ended with a recovered token
    accepted_per_position: list[int] = field(default_factory=list)  # [depth] -> rounds that accepted depth

    def record_round(self, drafted: int, accepted: int, emitted: int, bonus: bool) -> None:
        if drafted == 0:
            self.num_plain_rounds += 1
            return
        self.num_rounds += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_emitted += emitted
        self.num_bonus += bool(bonus)
        count_accepted_positions(self.accepted_per_position, accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative round, bonus/recovered token included (vLLM's convention)."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """vLLM's draft acceptance rate: accepted / drafted. For a chain, the chance a candidate is accepted;
        for a tree most nodes are siblings that cannot all be accepted: read accepted per round there."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.num_rounds for a in self.accepted_per_position] if self.num_rounds else []

    def as_dict(self) -> dict:
        r = self.num_rounds
        return {
            "rounds": r,
            "plain_decode_rounds": self.num_plain_rounds,
            "drafted_tokens": self.num_drafted,
            "accepted_tokens": self.num_accepted,
            "bonus_tokens": self.num_bonus,
            "recovered_tokens": r - self.num_bonus,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            # Trees: accepted tokens per round beside the nodes verified per round (the node budget).
            "accepted_per_round": round(self.num_accepted / r, 4) if r else 0.0,
            "nodes_per_round": round(self.num_drafted / r, 4) if r else 0.0,
            "acceptance_per_position": [round(a, 4) for a in self.acceptance_per_position],
        }


@dataclass
class RequestStats(RoundStats):
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the target's prefix cache at its last admission

    def as_dict(self) -> dict:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        return {**super().as_dict(), "ttft_s": None if ttft is None else round(ttft, 6),
                "cached_tokens": self.num_cached_tokens}


@dataclass(eq=False)  # identity: `req in running` must not compare every field of every request
class Request:
    seq_id: int  # internal, unique per engine
    request_id: str  # the user's id
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_target: int = 0  # tokens with committed KV in the target cache
    num_cached_draft: int = 0  # tokens with committed KV in the draft cache
    seed: int | None = None  # the sampling streams' seed: the user's, or one the engine drew
    priority: int = 0  # admission order: lower first (vLLM's convention); batch jobs run at 1, online at 0
    tenant: str | None = None  # who sent it (the API key, or None): what is cached across requests never mixes them
    stats: RequestStats = field(default_factory=RequestStats)
    # hashes of its first full blocks (scheduler/prefix_cache.py), grown as blocks fill; tokens never change
    block_hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_end(self) -> int:
        """Tokens to push through the target before speculative rounds begin.

        A fresh request prefills its whole prompt (the last prompt position yields the first token). A request
        resumed after preemption already has outputs: everything but its last token is recomputed, and that
        token is in flight like after any round.
        """
        return len(self.prompt_token_ids) if not self.output_token_ids else self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached_target < self.prefill_end

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
