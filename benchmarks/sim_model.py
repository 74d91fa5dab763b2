"""The cost model of the pipelining simulator: step times of sequential vs pipelined speculation.

A step verifies one round per running request. Costs are numbers (milliseconds), so the same acceptance trace
can be replayed on this machine's costs or on a cluster's:

    sequential:  draft(depth) + 2 msg + verify(tokens) + 2 msg + state
    pipelined:   [miss: redraft(depth) + 2 msg | hit: hit_propose]
                 + max(verify(tokens) * (1 + overlap_slowdown) + 2 msg, predraft(depth) + 2 msg) + state

A step *misses* when any of its rounds had no pre-drafted tree (or a prompt chunk had to be cached): the
controller waits for a re-draft before it can verify. ``overlap_slowdown`` is what the pre-draft running
beside the verify costs the verify: one CPU shared by both roles, ~0 with the draft on its own GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from benchmarks.trace import Step


@dataclass(frozen=True)
class CostModel:
    name: str
    draft_fixed_ms: float  # one draft call, besides its forwards
    draft_ms_per_level: float  # one draft forward (one tree level) at the batch the trace ran
    verify_fixed_ms: float  # one target forward over the batch, besides its per-token cost
    verify_ms_per_token: float  # marginal cost of a verified token (near 0 while memory-bound)
    predraft_ms_per_level: float  # one level of the pre-draft (width outcomes; ~draft level when memory-bound)
    msg_ms: float = 0.0  # one message hop controller <-> worker
    state_ms: float = 0.0  # controller per step: schedule, counters, emit
    overlap_slowdown: float = 0.0  # verify slows by this fraction while the pre-draft runs beside it
    hit_propose_ms: float = 0.0  # a step where every round hit: what propose still waits for
    redraft_ms_per_level: float | None = None  # a pipelined miss's re-draft level, if not a draft level
    source: str = ""

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, float | int) and not isinstance(v, bool) and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"cost model {self.name!r}: {k} must be a finite number >= 0, got {v!r}")

    def draft(self, depth: int) -> float:
        return self.draft_fixed_ms + self.draft_ms_per_level * depth

    def redraft(self, depth: int) -> float:
        per = self.draft_ms_per_level if self.redraft_ms_per_level is None else self.redraft_ms_per_level
        return self.draft_fixed_ms + per * depth

    def predraft(self, depth: int) -> float:
        # The in-flight chain and the prediction nodes take one more level than a re-draft.
        return self.draft_fixed_ms + self.predraft_ms_per_level * (depth + 1)

    def verify(self, tokens: int) -> float:
        return self.verify_fixed_ms + self.verify_ms_per_token * tokens


@dataclass(frozen=True)
class StepShape:
    """What the cost of a step depends on."""

    depth: int  # deepest tree in the step (0: no speculation)
    tokens: int  # tokens the target forwards: tree nodes + in-flight tokens + prompt chunks
    emitted: int
    spec_rounds: int  # rounds that carried a tree
    missed: bool  # measured: some round had no pre-drafted tree, or a prompt was cached
    prefill: bool


def shape(step: Step) -> StepShape:
    spec = [r for r in step.rounds if r.drafted > 0]
    return StepShape(depth=max((r.drafted for r in spec), default=0),
                     tokens=sum(r.drafted + 1 for r in step.rounds) + step.prefill_tokens,
                     emitted=sum(r.emitted for r in step.rounds),
                     spec_rounds=len(spec),
                     missed=step.prefill_tokens > 0 or any(r.hit is not True for r in spec),
                     prefill=step.prefill_tokens > 0)


def sequential_ms(s: StepShape, c: CostModel) -> float:
    draft = c.draft(s.depth) + 2 * c.msg_ms if s.depth or s.prefill else 0.0
    return draft + c.verify(s.tokens) + 2 * c.msg_ms + c.state_ms


def pipelined_ms(s: StepShape, c: CostModel, missed: bool) -> float:
    if s.depth == 0 and not s.prefill:
        return c.verify(s.tokens) + 2 * c.msg_ms + c.state_ms
    head = c.redraft(s.depth) + 2 * c.msg_ms if missed else c.hit_propose_ms
    verify = c.verify(s.tokens) * (1 + c.overlap_slowdown) + 2 * c.msg_ms
    return head + max(verify, c.predraft(s.depth) + 2 * c.msg_ms) + c.state_ms


@dataclass
class Result:
    tokens: int
    sequential_s: float
    pipelined_s: float
    hidden_s: float  # the "draft fully hidden" bound: every round a hit, drafting free, verify not slowed
    hit_rate: float  # measured, over rounds that carried a tree
    break_even: float | None  # the hit rate at which pipelining equals sequential (None: never)
    nowait_tokens: int = 0  # a policy that never waits for a re-draft: a missed round verifies no tree
    nowait_s: float = 0.0

    @property
    def nowait_tok_s(self) -> float:
        return self.nowait_tokens / self.nowait_s if self.nowait_s else 0.0

    @property
    def sequential_tok_s(self) -> float:
        return self.tokens / self.sequential_s if self.sequential_s else 0.0

    @property
    def pipelined_tok_s(self) -> float:
        return self.tokens / self.pipelined_s if self.pipelined_s else 0.0

    @property
    def hidden_tok_s(self) -> float:
        return self.tokens / self.hidden_s if self.hidden_s else 0.0


def expected_pipelined_ms(shapes: list[StepShape], c: CostModel, hit_rate: float) -> float:
    """Each round hits independently with ``hit_rate``; a step avoids the re-draft only if all of its rounds hit."""
    total = 0.0
    for s in shapes:
        p_all = 0.0 if s.prefill else hit_rate ** s.spec_rounds
        total += p_all * pipelined_ms(s, c, False) + (1 - p_all) * pipelined_ms(s, c, True)
    return total


def break_even(shapes: list[StepShape], c: CostModel) -> float | None:
    """The smallest per-round hit rate at which pipelining is as fast as sequential speculation."""
    seq = sum(sequential_ms(s, c) for s in shapes)
    if expected_pipelined_ms(shapes, c, 0.0) <= seq:
        return 0.0
    if expected_pipelined_ms(shapes, c, 1.0) > seq:
        return None
    lo, hi = 0.0, 1.0  # expected time falls as the hit rate rises
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_pipelined_ms(shapes, c, mid) > seq else (lo, mid)
    return hi


def nowait(steps: list[Step], c: CostModel) -> tuple[int, float]:
    """Tokens and seconds if a step never waited for a re-draft: a round that missed verifies no tree and emits
    one token, the others as recorded. An estimate: the trace's later rounds followed the recorded ones."""
    tokens, ms = 0, 0.0
    for step in steps:
        s = shape(step)
        ms += pipelined_ms(s, c, s.prefill)
        tokens += sum(r.emitted if r.hit or r.drafted == 0 else 1 for r in step.rounds)
    return tokens, ms / 1e3


def replay(steps: Iterable[Step], c: CostModel) -> Result:
    steps = list(steps)
    shapes = [shape(s) for s in steps]
    rounds = [r for s in steps for r in s.rounds if r.drafted > 0]
    hidden = CostModel(**{**asdict(c), "overlap_slowdown": 0.0, "predraft_ms_per_level": 0.0, "draft_fixed_ms": 0.0,
                          "hit_propose_ms": 0.0})
    return Result(tokens=sum(s.emitted for s in shapes),
                  sequential_s=sum(sequential_ms(s, c) for s in shapes) / 1e3,
                  pipelined_s=sum(pipelined_ms(s, c, s.missed) for s in shapes) / 1e3,
                  hidden_s=sum(pipelined_ms(s, hidden, s.prefill) for s in shapes) / 1e3,
                  hit_rate=sum(r.hit is True for r in rounds) / len(rounds) if rounds else 0.0,
                  break_even=break_even(shapes, c), **dict(zip(("nowait_tokens", "nowait_s"), nowait(steps, c),
                                                               strict=True)))


def hits_by_accepted(steps: Iterable[Step]) -> dict[int, tuple[int, int]]:
    """accepted length of round r -> (rounds r+1 of the same request that hit, rounds r+1 seen): where the
    pipeline's predictions come true, by the position the previous round stopped at."""
    last: dict[int, int] = {}  # seq -> accepted length of its last round
    out: dict[int, tuple[int, int]] = {}
    for step in steps:
        for r in step.rounds:
            if r.drafted == 0:
                continue
            if r.seq in last and r.hit is not None:
                h, n = out.get(last[r.seq], (0, 0))
                out[last[r.seq]] = (h + bool(r.hit), n + 1)
            last[r.seq] = r.accepted
    return dict(sorted(out.items()))
