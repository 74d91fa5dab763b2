"""Which drafter a speculative config runs: none, draftless / self-drafting (no draft worker), sequential or
pipelined calls to a draft worker. Called at engine start and again whenever a replaced draft comes back."""

from __future__ import annotations

from engine.core.config import SpeculativeConfig
from engine.core.metrics import SpecDecodingStats, StepTimes
from engine.drafting.drafter import DraftCalls, Drafter, NoDrafter, SequentialDrafter
from engine.drafting.draftless import DRAFTLESS_METHODS, draftless_drafter
from engine.drafting.layer_skip import LayerSkipDrafter
from engine.drafting.layer_skip_config import LAYER_SKIP
from engine.drafting.pipelined_drafter import PipelinedDrafter
from scheduler.adaptive import AdaptivePolicy
from scheduler.scheduler import Scheduler
from scheduler.spec_policy import TreeShape


def build_drafter(spec: SpeculativeConfig | None, executor, scheduler: Scheduler, stats: SpecDecodingStats,
                  times: StepTimes, tree: TreeShape | None, draft_max_len: int,
                  ) -> tuple[Drafter, DraftCalls | None, PipelinedDrafter | None]:
    """The drafter, the draft-worker calls it makes (their forward times feed the step's timing) and the
    pipelined drafter when it is one (its stats are reported apart)."""
    if spec is None:
        return NoDrafter(), None, None
    draft_tables = scheduler.draft_blocks.tables if scheduler.draft_blocks is not None else {}
    calls = DraftCalls(executor, times, draft_tables)  # draftless: never called
    if spec.method == LAYER_SKIP:  # the target drafts itself; its passes' times go where a draft worker's would
        return LayerSkipDrafter(executor, times, scheduler.target_blocks.tables, calls), calls, None
    if spec.method in DRAFTLESS_METHODS or spec.draft_spec is None:  # no draft worker
        return draftless_drafter(spec, stats, executor, times, scheduler), calls, None
    if spec.pipeline:
        policy = scheduler.policy
        pipeline = PipelinedDrafter(calls, tree, draft_max_len, policy.reach, spec.pipeline_width)
        pipeline.switch.enabled = spec.pipeline_switch
        if isinstance(policy, AdaptivePolicy):
            pipeline.switch.config = policy.config
        return pipeline, calls, pipeline
    return SequentialDrafter(calls, lazy_prefill=scheduler.lazy_draft_prefill), calls, None
