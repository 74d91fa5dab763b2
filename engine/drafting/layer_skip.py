"""The ``Drafter`` of self-speculation (method ``layer_skip``): the target's worker drafts each round's chain.

One self-draft call before each verify call, ints both ways; the laws stay in the target's own law store and the
early layers' KV and hidden states in its cache and pad (the design note: workers/layer_skip/__init__.py). The
keys and the choice of exit: engine/drafting/layer_skip_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.metrics import StepTimes
from engine.drafting.drafter import NO_TREE, sampling_spec
from scheduler.scheduler import ScheduledBatch
from workers.layer_skip.messages import SelfDraftSeq, SelfDraftStep
from workers.messages import DraftTree, TargetStepOutput


@dataclass
class LayerSkipDrafter:
    """The ``Drafter`` of method layer_skip: the target's worker drafts each scheduled round's chain."""

    executor: Any  # engine.execution.executor.LocalExecutor (self_draft)
    times: StepTimes
    tables: Any  # the target's block tables (the scheduler's; read only): drafting writes their scratch slots
    _out: list[DraftTree] = field(default_factory=list)

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        msg = SelfDraftStep([SelfDraftSeq(r.seq_id, self.tables[r.seq_id], r.num_cached_target,
                                          r.all_token_ids[r.num_cached_target:], sampling_spec(r), len(shape))
                             for r, shape in zip(batch.rounds, batch.shapes, strict=True) if shape])
        if not msg.seqs:
            return [NO_TREE] * len(batch.rounds)
        out = self.executor.self_draft(msg)
        self.times.draft_s += out.elapsed_s
        trees = {s.seq_id: t for s, t in zip(msg.seqs, out.trees, strict=True)}
        return [trees.get(r.seq_id, NO_TREE) for r in batch.rounds]

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        return {}  # no draft KV of its own: the accepted rows' KV is the target's, committed by the verify
