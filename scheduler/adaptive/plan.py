"""The planner (pure): each request's round this step, chosen to maximise the batch's expected tokens per second
(docs/adaptive.md, The planner). A round's source is a name priced with its own acceptance and costs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.adaptive.acceptance import expected_tokens
from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.costs import CostModel, StepLoad

PLAIN, DRAFT = "plain", "draft"  # drafting sources


@dataclass
class Req:
    """What the planner needs of a request."""

    seq_id: int
    cap: int  # deepest round allowed (remaining tokens, contexts)
    inflight: int  # target tokens fed before the tree
    catchup: int  # draft tokens its first forward really carries (every token since it last drafted)
    rates: list[float]  # chain acceptance per position, length >= cap
    tree_rates: list[float] | None = None  # the configured tree's, per level (None: the tree is a chain)
    lag: float | None = None  # draft tokens its first forward is priced at (None: ``catchup``, paid this round)
    greedy: bool = True
    pinned: tuple[int, ...] | None = None  # the shape it must run (not the planner's choice)
    source: str = DRAFT  # who proposes its candidates
    forwards: bool = True  # they cost draft-model forwards (False: a proposer in the controller, ~free)


@dataclass(frozen=True)
class Round:
    seq_id: int
    source: str
    shape: tuple[int, ...]  # branching per level; () for plain decode


@dataclass
class Plan:
    rounds: list[Round]
    tokens: float  # expected emitted tokens
    seconds: float  # predicted step seconds
    load: StepLoad = field(default_factory=StepLoad)  # what the step really carries (catch-ups as they are)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [r.shape for r in self.rounds]

    @property
    def speculates(self) -> bool:
        return any(r.shape for r in self.rounds)


def _rates(r: Req, shape: tuple[int, ...]) -> list[float]:
    return r.tree_rates if r.tree_rates is not None and any(w > 1 for w in shape) else r.rates


def _first_forward(r: Req, shape: tuple[int, ...], steady: bool) -> float:
    """Draft tokens of the round's first forward as priced. Steady (``lag`` set): after a round whose every
    candidate was accepted the draft also feeds the last candidate, so a request speculating at depth d each round
    feeds 1 + P(all d accepted), plus its catch-up spread over the rounds it has left."""
    if not steady or r.lag is None:
        return r.catchup
    return r.lag + (math.prod(_rates(r, shape)[: len(shape)]) if shape else 0.0)


def real_load(reqs: Sequence[Req], shapes: Sequence[tuple[int, ...]]) -> StepLoad:
    """The step's token accounting as it will run (the engine times this; the planner prices the same)."""
    load = StepLoad(sampled=any(not r.greedy for r in reqs))
    for r, s in zip(reqs, shapes, strict=True):
        load.add(r.inflight, r.catchup, s, r.forwards)
    return load


def price(reqs: Sequence[Req], shapes: Sequence[tuple[int, ...]], costs: CostModel, steady: bool = True) -> Plan:
    """Expected tokens and predicted seconds of a step running these shapes."""
    load, tokens = StepLoad(), 0.0
    for r, s in zip(reqs, shapes, strict=True):
        load.add(r.inflight, _first_forward(r, s, steady), s, r.forwards)
        tokens += expected_tokens(_rates(r, s), len(s))
    rounds = [Round(r.seq_id, r.source if s else PLAIN, tuple(s)) for r, s in zip(reqs, shapes, strict=True)]
    return Plan(rounds, tokens, costs.step_seconds(load), real_load(reqs, shapes))


def plan(reqs: Sequence[Req], costs: CostModel, tree: tuple[int, ...], config: AdaptiveConfig,
         previous: Mapping[int, tuple[int, ...]] | None = None) -> Plan:
    """The best plan on the menu (chains, the configured tree, plain decode; pinned requests keep their shape),
    or the previous step's shapes if the best does not beat them by ``hysteresis``."""
    with costs.planning():  # the curves hold still while the menu is priced: each price is computed once
        return _plan(reqs, costs, tree, config, previous)


def _plan(reqs: Sequence[Req], costs: CostModel, tree: tuple[int, ...], config: AdaptiveConfig,
          previous: Mapping[int, tuple[int, ...]] | None) -> Plan:
    plain = [r.pinned if r.pinned is not None else () for r in reqs]
    if not costs.knows_batch_size(len(reqs)):  # plain decode measures this batch size first
        return price(reqs, plain, costs)
    best = best_chains(reqs, costs, config)
    if any(w > 1 for w in tree):
        t = price(reqs, [r.pinned if r.pinned is not None else tree[: r.cap] for r in reqs], costs)
        best = t if t.rate > best.rate else best
    if previous and any(r.seq_id in previous for r in reqs):
        shapes = [r.pinned if r.pinned is not None else previous.get(r.seq_id, s)[: r.cap]
                  for r, s in zip(reqs, best.shapes, strict=True)]
        if shapes != best.shapes:
            prev = price(reqs, shapes, costs)
            if best.rate < prev.rate * (1 + config.hysteresis):
                best = prev
    return best


def best_chains(reqs: Sequence[Req], costs: CostModel, config: AdaptiveConfig) -> Plan:
    """Candidates by value; per depth cap the best prefix of those under it; the best if it beats plain decode
    by ``spec_margin``. Pinned requests keep their shapes."""
    free = [i for i, r in enumerate(reqs) if r.pinned is None]
    base, tokens0 = StepLoad(), 0.0
    for r in reqs:
        s = r.pinned or ()
        base.add(r.inflight, _first_forward(r, s, True) if s else 0.0, s, r.forwards)
        tokens0 += expected_tokens(_rates(r, s), len(s))
    cands = sorted((-math.prod(reqs[i].rates[: j + 1]), j, i) for i in free for j in range(reqs[i].cap))
    plain_rate = tokens0 / max(costs.step_seconds(base), 1e-12)
    best_rate, best_cut = plain_rate, []
    deepest = max((j for _, j, _ in cands), default=-1) + 1
    for cap in range(deepest, 0, -1):
        cut = [c for c in cands if c[1] < cap]
        n, rate = _best_prefix(reqs, cut, base, tokens0, costs, config.search_prices)
        if n and rate > best_rate:
            best_rate, best_cut = rate, cut[:n]
    if best_cut and best_rate < plain_rate * (1 + config.spec_margin):
        best_cut = []
    depths = [0] * len(reqs)
    for _, j, i in best_cut:
        depths[i] = max(depths[i], j + 1)
    return price(reqs, [r.pinned if r.pinned is not None else (1,) * depths[i] for i, r in enumerate(reqs)], costs)


def _best_prefix(reqs: Sequence[Req], cands: list[tuple[float, int, int]], base: StepLoad, tokens: float,
                 costs: CostModel, prices: int) -> tuple[int, float]:
    """The best non-empty prefix of ``cands`` on top of ``base`` (its length and rate), priced in ~``prices``
    strides with no early stop: the first candidates pay the call's fixed part, so the rate dips and recovers."""
    load = dataclasses.replace(base, forward_tokens=list(base.forward_tokens), forward_seqs=list(base.forward_seqs))
    reached = [0.0] * len(reqs)  # value of each request's deepest candidate so far
    best_n, best_rate = 0, 0.0
    stride = max(1, -(-len(cands) // prices))
    for n, (neg_value, j, i) in enumerate(cands, start=1):
        r = reqs[i]
        load.verify_tokens += 1
        if r.forwards:
            load.feed(j, (r.lag if r.lag is not None else r.catchup) if j == 0 else 1)
        if r.lag is not None and r.forwards:  # the steady catch-up moves with the chain's reach: 1 + P(all accepted)
            load.feed(0, -neg_value - reached[i], 0)
            reached[i] = -neg_value
        tokens -= neg_value
        if n % stride and n != len(cands):
            continue
        rate = tokens / max(costs.step_seconds(load), 1e-12)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n, best_rate
