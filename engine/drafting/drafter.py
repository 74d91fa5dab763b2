"""Drafting a round's candidate trees: the ``Drafter`` interface and the sequential drafter.

Each step the controller asks the drafter for the batch's trees (``propose``), gives it the time the target
spends verifying (``overlap``), then hands it the verified round (``commit``); ``commit`` says which draft KV
the round made real and returns the draft's committed length per sequence, for the scheduler, which owns the
counters. The implementations:

- ``NoDrafter``: no speculation; every round is a plain decode round.
- ``SequentialDrafter`` (here): draft, then verify, one after the other.
- ``PipelinedDrafter`` (engine/drafting/pipelined_drafter.py): draft round r+1 while the target verifies round r.
- ``ControllerDrafter`` / ``FallbackDrafter`` (engine/drafting/controller_drafter.py): n-gram and suffix proposals
  from the request's tokens, no draft worker (one-hot laws), alone or in front of a ``SequentialDrafter``.

A drafter is built from what it uses: the executor (the draft worker's side of it), the draft's block tables
(a read-only view of the scheduler's), the tree shape and the step timers. The trees it hands back are ints;
their laws went from the draft worker to the verifier directly (workers/law_channel.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.metrics import StepTimes
from engine.structured.draft_grammar import DraftGrammars
from scheduler.request import Request
from scheduler.scheduler import ScheduledBatch
from workers.messages import (
    DraftCommit,
    DraftSeq,
    DraftStep,
    DraftStepOutput,
    DraftTree,
    PrefillSeq,
    SamplingSpec,
    TargetStepOutput,
)

NO_TREE = DraftTree(tokens=[], parents=[], tree_id=-1, kv_depth=0, likely_path=[])


class Drafter(Protocol):
    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        """One tree per round of ``batch`` (NO_TREE where it drafts nothing). ``gone``: sequences finished or
        preempted since the last step, whose draft state is dropped."""
        ...

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        """Called once the target call is submitted, before waiting for it."""
        ...

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        """The verified round: the draft's new committed length of every sequence whose draft KV advanced."""
        ...


def sampling_spec(req: Request) -> SamplingSpec:
    p = req.params
    return SamplingSpec(p.temperature, p.top_k, p.top_p, p.min_p, req.seed,
                        -1 if p.logprobs is None else p.logprobs, p.logprobs_mode)


@dataclass
class DraftCalls:
    """The draft worker's side of the executor, with its time accounted."""

    executor: object  # engine.execution.executor.Executor
    times: StepTimes
    tables: Mapping[int, list[int]]  # the draft's block tables (the scheduler's; read only)
    # the last waited-for call's forwards (worker seconds each; the engine clears it before a step it times)
    forward_s: list[float] = field(default_factory=list)

    def submit(self, msg: DraftStep) -> None:
        self.executor.submit_draft(msg)

    def wait(self) -> DraftStepOutput:
        return self.executor.wait_draft()

    def run(self, msg: DraftStep) -> DraftStepOutput:
        """A call the controller waits for: its worker time counts as the step's draft time."""
        self.submit(msg)
        out = self.wait()
        self.times.draft_s += out.elapsed_s
        self.forward_s = out.forward_s
        return out

    def prefills(self, batch: ScheduledBatch) -> list[PrefillSeq]:
        """The batch's prompt chunks, cached by the draft too (no logits). A chunk starts where the draft's cache
        ends: before the target's after a prefix-cache hit the draft had only in part (scheduler/scheduler.py)."""
        return [PrefillSeq(c.req.seq_id, self.tables[c.req.seq_id], s, c.req.all_token_ids[s:c.end])
                for c in batch.prefills for s in (min(c.start, c.req.num_cached_draft),)]

    def seq(self, req: Request, base_len: int, branching: list[int], **kw) -> DraftSeq:
        """Draft below the request's last token, feeding every token from ``base_len`` on."""
        return DraftSeq(req.seq_id, self.tables[req.seq_id], base_len, req.all_token_ids[base_len:],
                        sampling_spec(req), branching, **kw)


class NoDrafter:
    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        return [NO_TREE] * len(batch.rounds)

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        return {}


@dataclass
class SequentialDrafter:
    """Drafts each round's trees from the committed prefix, then waits for them.

    The draft forwards the in-flight tokens and every level of the tree but the deepest; after verification the
    in-flight tokens and the accepted nodes that were forwarded hold valid draft KV. The draft worker moves
    them into place at the start of its next call (``DraftCommit``: it knows where it put them).
    """

    calls: DraftCalls
    lazy_prefill: bool = False  # prompt chunks are not sent: the first round feeds the prefix (Scheduler's flag)
    _inflight: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (base_len, in-flight tokens)
    _commits: dict[int, DraftCommit] = field(default_factory=dict)  # applied with the next call
    _gone: list[int] = field(default_factory=list)  # finished/preempted, dropped by the worker with the next call
    grammars: DraftGrammars = field(default_factory=DraftGrammars)  # grammar requests' draft masks

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        for s in gone:
            self._commits.pop(s, None)
        self._gone += gone
        self.grammars.forget(gone)
        self._inflight.clear()
        msg = DraftStep(prefills=[] if self.lazy_prefill else self.calls.prefills(batch))
        for r, shape in zip(batch.rounds, batch.shapes, strict=True):
            if shape:  # the scheduler's policy chose this round's branching
                msg.seqs.append(self.calls.seq(r, r.num_cached_draft, list(shape), grammar=self.grammars.update(r)))
                self._inflight[r.seq_id] = (r.num_cached_draft, r.num_tokens - r.num_cached_draft)
        if not msg.seqs and not msg.prefills:
            # A plain step (the adaptive policy's K = 0 for everyone): no draft call at all. Its hand-off cost
            # 0.2-5 ms a step on a loaded CPU (4-10 % of a plain step at batch 8-32) for nothing; the pending
            # commits and dropped ids keep until the next call, which applies them first (as it does anyway).
            return [NO_TREE] * len(batch.rounds)
        msg.commits, msg.finished = list(self._commits.values()), self._gone
        self._commits, self._gone = {}, []
        trees = {res.seq_id: res.trees[0] for res in self.calls.run(msg).results}
        return [trees.get(r.seq_id, NO_TREE) for r in batch.rounds]

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        cached = {}
        for r, tree, res in zip(batch.rounds, trees, out.results, strict=True):
            if r.seq_id in self._inflight:
                self._commits[r.seq_id], cached[r.seq_id] = keep_drafted(r.seq_id, *self._inflight[r.seq_id],
                                                                         tree, res.accepted_nodes)
        return cached


def keep_drafted(seq_id: int, base_len: int, num_inflight: int, tree: DraftTree,
                 accepted_nodes: list[int]) -> tuple[DraftCommit, int]:
    """After a round drafted from ``base_len`` (``num_inflight`` tokens fed, then the tree): the draft KV to keep
    (the in-flight tokens and the accepted nodes that were forwarded; the deepest level never was) and the draft's
    committed length after it."""
    kept = accepted_nodes[: tree.kv_depth]
    return DraftCommit(seq_id, num_inflight, kept), base_len + num_inflight + len(kept)
