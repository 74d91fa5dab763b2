"""Building the drafter of a draftless method (``ngram`` / ``suffix``), with its draft-model fallback if any."""

from __future__ import annotations

from typing import Any

from engine.core.metrics import SpecDecodingStats, StepTimes
from engine.drafting.controller_drafter import ControllerDrafter, FallbackDrafter
from engine.drafting.drafter import DraftCalls, Drafter, SequentialDrafter
from engine.drafting.draftless_config import DRAFTLESS_METHODS, ngram_config, suffix_config
from engine.drafting.ngram import NgramProposer
from engine.drafting.suffix import SuffixProposer
from scheduler.adaptive import AdaptivePolicy
from scheduler.adaptive.sources import Sources
from scheduler.scheduler import Scheduler

__all__ = ["DRAFTLESS_METHODS", "draftless_drafter"]


def draftless_drafter(spec: Any, stats: SpecDecodingStats, executor: Any, times: StepTimes,
                      scheduler: Scheduler) -> Drafter:
    """``spec``: a SpeculativeConfig whose method is draftless (engine/core/config.py)."""
    proposer = (NgramProposer(ngram_config(spec)) if spec.method == "ngram" else SuffixProposer(suffix_config(spec)))
    primary = ControllerDrafter(proposer, stats)
    policy = scheduler.policy
    adaptive = isinstance(policy, AdaptivePolicy)
    if adaptive:  # the policy prices the proposer's match (and the fallback model) per request before each round
        policy.sources = Sources(primary.match, proposer.name, spec.fallback.tree_shape.depth if spec.fallback else 0)
    if spec.fallback is None:
        return primary
    calls = DraftCalls(executor, times, scheduler.draft_blocks.tables)
    model = SequentialDrafter(calls, lazy_prefill=scheduler.lazy_draft_prefill)
    return FallbackDrafter(primary, model, spec.fallback.tree_shape.branching, stats,
                           source_of=policy.source_of if adaptive else None)
