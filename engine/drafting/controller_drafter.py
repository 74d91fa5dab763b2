"""Drafting where the tokens are: proposers that read the request's tokens in the controller (n-gram, suffix),
alone or in front of a draft model.

A proposer's candidates are a function of the tokens it has seen, so each node's law is one-hot at its token:
the trees go out with ``ONE_HOT_TREE`` and the verifier builds those laws itself (the deterministic-children
rule; no draft worker, nothing but ints through the controller). A round where the proposer finds no match is a
plain decode round, or, with a fallback, the draft model's round (``FallbackDrafter``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.metrics import SpecDecodingStats
from engine.drafting.drafter import NO_TREE, SequentialDrafter
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import branching_nodes
from workers.messages import ONE_HOT_TREE, DraftTree, TargetStepOutput

MODEL_SOURCE = "draft_model"  # the source name of a fallback's trees in the statistics


class Proposer(Protocol):
    name: str  # the source name in the statistics ("ngram", "suffix")

    def propose(self, seq_id: int, token_ids: list[int], max_nodes: int, max_depth: int,
                tenant: str | None = None, shared: bool = True) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a tree of at most max_nodes nodes and max_depth levels; ([], []) for none.
        ``shared`` false: from the request's own tokens only (nothing other requests left)."""
        ...

    def forget(self, seq_id: int, output: list[int] | None = None, tenant: str | None = None) -> None:
        """The request left; ``output``: a finished (not aborted) request's output, which it may keep."""
        ...


@dataclass
class ControllerDrafter:
    """The ``Drafter`` over a ``Proposer``: a tree for every round the policy gave a shape and a match was found."""

    proposer: Proposer
    stats: SpecDecodingStats | None = None  # where the per-source counts go
    _running: dict[int, Request] = field(default_factory=dict)  # seq_id -> request, to settle it when it leaves

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        self.settle(gone)
        trees = []
        for r, shape in zip(batch.rounds, batch.shapes, strict=True):
            tokens, parents = self._lookup(r, branching_nodes(shape), len(shape)) if shape else ([], [])
            trees.append(DraftTree(tokens, parents, ONE_HOT_TREE, 0, []) if tokens else NO_TREE)
        return trees

    def match(self, req: Request, max_depth: int) -> int:
        """How deep a chain the proposer has for ``req`` now (0: no match): the adaptive policy prices it before it
        plans the round (scheduler/adaptive/sources.py)."""
        _, parents = self._lookup(req, max_depth, max_depth)
        depth: list[int] = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return max(depth, default=0)

    def _lookup(self, r: Request, max_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
        self._running[r.seq_id] = r  # its proposer state is dropped when it leaves (settle)
        # A seeded sampled request's tokens depend on the trees it was offered: from its own tokens only, so that
        # its seed reproduces them whatever other requests came before.
        shared = r.params.seed is None or r.params.greedy
        return self.proposer.propose(r.seq_id, r.all_token_ids, max_nodes, max_depth, r.tenant, shared)

    def settle(self, gone: list[int]) -> None:
        """Requests finished or preempted since the last step: their state goes; a finished output may stay."""
        for s in gone:
            req = self._running.pop(s, None)
            if req is None:
                continue
            done = req.status == RequestStatus.FINISHED and req.finish_reason != FinishReason.ABORT
            self.proposer.forget(s, list(req.output_token_ids) if done else None, req.tenant)

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        record_sources(self.stats, [self.proposer.name if t.num_nodes else None for t in trees], trees, out)
        return {}  # no draft KV


@dataclass
class FallbackDrafter:
    """The proposer where it has a match, the draft model (at its own, shallower shape) elsewhere, per request
    per round; under the adaptive policy (``source_of``), whichever source the policy priced best for the request,
    at the planned shape. The draft model catches up on the rounds it skipped by feeding their tokens next time."""

    primary: ControllerDrafter
    model: SequentialDrafter
    model_branching: tuple[int, ...]  # the fallback's own tree (within the round's reserved nodes)
    stats: SpecDecodingStats | None = None
    source_of: Callable[[int], str] | None = None  # seq_id -> the policy's source this step (None: proposer first)
    _sources: list[str | None] = field(default_factory=list)

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        if self.source_of is not None:
            name = self.primary.proposer.name
            mine = [s if self.source_of(r.seq_id) == name else () for r, s in zip(batch.rounds, batch.shapes,
                                                                                  strict=True)]
            trees = self.primary.propose(dataclasses.replace(batch, shapes=mine), gone)
            shapes = [() if m else s for s, m in zip(batch.shapes, mine, strict=True)]
        else:
            trees = self.primary.propose(batch, gone)
            shapes = [self.model_branching[: len(s)] if s and not t.num_nodes else () for s, t in
                      zip(batch.shapes, trees, strict=True)]
        model_trees = self.model.propose(dataclasses.replace(batch, shapes=shapes), gone)
        self._sources = [self.primary.proposer.name if t.num_nodes else MODEL_SOURCE if m.num_nodes else None
                         for t, m in zip(trees, model_trees, strict=True)]
        return [t if t.num_nodes else m for t, m in zip(trees, model_trees, strict=True)]

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        pass

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        record_sources(self.stats, self._sources, trees, out)
        return self.model.commit(batch, trees, out)  # only the rounds it drafted are its own


def record_sources(stats: SpecDecodingStats | None, sources: list[str | None], trees: list[DraftTree],
                   out: TargetStepOutput) -> None:
    if stats is None or not out.results:
        return
    for src, tree, res in zip(sources, trees, out.results, strict=True):
        if src is not None:
            stats.record_source(src, tree.num_nodes, res.num_accepted)
