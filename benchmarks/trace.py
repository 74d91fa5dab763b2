"""Acceptance traces from real runs, for the simulator (benchmarks/simulate.py).

``TraceDrafter`` wraps the engine's drafter for the length of a run and records, per step, each round's
drafted / accepted / emitted counts, whether its tree came pre-drafted (a pipeline *hit*) and the step's
measured times. With pipelining on and off the outputs (greedy, or seeded at T > 0) are identical, so one
pipelined run's trace holds both the accepted lengths the chain would see and the hits pipelining gets.

JSONL, one object a line: a header ``{"kind": "header", ...}`` with the run's settings, then one
``{"kind": "step", ...}`` per engine step (``Step`` below).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine's drafter protocol, named in annotations only
    from engine.drafting.drafter import Drafter
    from scheduler.scheduler import ScheduledBatch
    from workers.messages import DraftTree, TargetStepOutput


@dataclass
class RoundTrace:
    seq: int
    drafted: int  # tree nodes verified (the chain's depth)
    accepted: int
    emitted: int  # accepted + the recovered / bonus token
    hit: bool | None  # the tree was pre-drafted (None: not a pipelined run)


@dataclass
class Step:
    rounds: list[RoundTrace] = field(default_factory=list)
    prefill_tokens: int = 0
    propose_s: float = 0.0  # controller wall time in propose (the draft calls it waited for)
    verify_wall_s: float = 0.0  # from the target's submit to its answer (the pre-draft runs beside it)
    verify_s: float = 0.0  # the target worker's own time
    collect_s: float = 0.0  # the drafter's commit: waiting for the pre-draft, matching
    predraft_s: float = 0.0  # the draft worker's time on the pre-draft (pipelined)
    step_s: float = 0.0  # propose start to commit end

    def as_json(self) -> dict:
        return {"kind": "step", **asdict(self)}

    @staticmethod
    def from_json(d: dict) -> Step:
        rounds = [RoundTrace(**r) for r in d.get("rounds", [])]
        return Step(rounds, **{k: v for k, v in d.items() if k not in ("kind", "rounds")})


@dataclass
class TraceDrafter:
    """A ``Drafter`` that passes every call to ``inner`` and writes one ``Step`` per engine step."""

    inner: Drafter
    out: IO[str]
    _step: Step | None = None
    _t0: float = 0.0
    _t_submit: float = 0.0

    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        self._t0 = time.perf_counter()
        has_tree = getattr(self.inner, "has_tree", None)  # only the pipelined drafter pre-drafts
        hits = [has_tree(r.seq_id) if has_tree else None for r in batch.rounds]
        trees = self.inner.propose(batch, gone)
        self._step = Step(prefill_tokens=sum(c.end - c.start for c in batch.prefills))
        self._step.rounds = [RoundTrace(r.seq_id, t.num_nodes, 0, 0, h)
                             for r, t, h in zip(batch.rounds, trees, hits, strict=True)]
        self._t_submit = time.perf_counter()
        self._step.propose_s = self._t_submit - self._t0
        return trees

    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        self.inner.overlap(batch, trees)

    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        t = time.perf_counter()
        stats = getattr(self.inner, "stats", None)  # the pipelined drafter's: draft worker time so far
        busy = stats.draft_busy_s if stats is not None else 0.0
        cached = self.inner.commit(batch, trees, out)
        end = time.perf_counter()
        s = self._step
        assert s is not None, "commit without propose"
        for rt, res in zip(s.rounds, out.results, strict=True):
            rt.accepted, rt.emitted = res.num_accepted, len(res.tokens)
        s.predraft_s = (stats.draft_busy_s - busy) if stats is not None else 0.0
        s.verify_wall_s, s.verify_s, s.collect_s, s.step_s = t - self._t_submit, out.elapsed_s, end - t, end - self._t0
        self.out.write(json.dumps(s.as_json()) + "\n")
        self._step = None
        return cached


def read_trace(path: str) -> tuple[dict[str, Any], list[Step]]:
    """The header and the steps of a trace file."""
    header: dict[str, Any] = {}
    steps: list[Step] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if d.get("kind") == "header":
                header = d
            elif d.get("kind") == "step":
                steps.append(Step.from_json(d))
    return header, steps
