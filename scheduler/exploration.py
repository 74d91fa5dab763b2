"""Exploration for the adaptive speculation policy: which plan it is not using to run for one step, and when.

A cost curve is only trusted near sizes it measured, so the policy (scheduler/adaptive.py) now and then runs one
step of a plan it is not using (plain decode or the configured depth while it speculates; while it does not, the
configured shape on a few requests, as many candidates as chains of 1 or of half the depth for everyone) when
that size was not measured lately at this batch size: after 8 to ``explore_every`` steps, sooner the less time
the step is predicted to lose against the chosen plan (~3 % of the time spent exploring when the prediction is
right, less where an exploration step is many chosen steps long, or, from plain decode, where its plan is
predicted far slower than plain decode; a wrong one, e.g. a size first measured while another process ran, is
corrected in tens of steps where exploring is cheap), and further apart each time a re-measurement finds the
price where it was.

``Exploration`` is the policy's base class: its settings are the policy's keyword fields, and its methods price
with the planner's own ``price``, pinned rounds and regime curves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.spec_policy import branching_nodes

if TYPE_CHECKING:
    from scheduler.cost_model import CostModel
    from scheduler.plan_search import _Plan, _Req
    from scheduler.spec_policy import SpecPolicy


@dataclass(kw_only=True)
class Exploration:
    explore_every: int = 256  # steps before a size the policy does not use is measured again, at most
    # ... and at least ``explore_min`` steps, sooner the cheaper the exploration step is predicted to be: one that
    # loses L seconds against the chosen plan (its own seconds less the time the chosen plan would take for its
    # tokens), every L / (explore_budget x chosen step seconds) steps, spends ~explore_budget of the time when the
    # prediction is right, and corrects a wrong one quickly where it matters.
    explore_min: int = 8
    explore_budget: float = 0.03
    # ... scaled down by the exploration step's length over ``explore_stall`` chosen steps: such a step stalls
    # every stream of the batch at once, and where it is that long (a few requests feeding their drafts their
    # whole prefixes at saturation) it is also the one least likely to be chosen. At concurrency 64 (larger random
    # pair, T = 0.8, waves of 48-token requests) one took 3 s against 0.5 s for a plain step, and runs with one or
    # two of them were 5-9 % slower than no speculation; at batch 1 an exploration is 1-3 chosen steps long.
    explore_stall: float = 3.0
    # Each exploration of a size that found its price where it was doubles that size's interval, up to
    # 2 ** explore_backoff times (a miss resets it): at batch 1 plain decode is cheap to explore and so was
    # re-measured every 8 steps, 2-3 % of the time spent confirming what the policy knew.
    explore_backoff: int = 3
    # A plan whose exploration step is predicted to take over ``explore_stall`` chosen steps, and whose steady rate
    # (its catch-up spread as the plan prices it) is below this fraction of the chosen plan's, is not explored: only
    # a curve wrong by more than 1 / explore_floor could make it the better one. At concurrency 64 (larger random
    # pair, T = 0.8) the configured depth for everyone (512 candidates, predicted at 0.57x their rate) was explored
    # while chains of 1 ran: one 5 s step, 8 % of the run. A shorter one is explored whatever its rate: at batch 1
    # the configured depth is 1-3 steps long, and a wrong curve there (one measured while another process ran was
    # 2.7x too dear) is corrected at little cost.
    explore_floor: float = 0.67
    # While plain decode runs, an exploration's budget is scaled by (its plan's steady rate / plain decode's) to
    # this power (``_odds``); 0: every plan gets the whole budget.
    explore_odds: float = 2.0
    explored_steps: int = 0  # steps that ran an exploration
    # Whether the chosen plan speculates, and steps since that last changed: the candidates differ on either side
    # (``_exploration``), and a size never measured at this batch size counts its age from when it became one.
    _speculating: bool | None = None
    _mode_steps: int = 0

    if TYPE_CHECKING:  # the planner's (scheduler/adaptive.py), used here
        base: SpecPolicy
        _cost: CostModel | None
        _pinned: list[tuple[_Req, tuple[int, ...]]]

        def price(self, rs: Sequence[_Req], shapes: Sequence[tuple[int, ...]]) -> _Plan: ...
        def _pinned_verify(self) -> int: ...

    def _exploration(self, rs: Sequence[_Req], chosen: _Plan, fixed: list[tuple[int, ...]], prefill: bool = False
                     ) -> list[tuple[int, ...]] | None:
        """One step of a plan not in use (plain decode or the configured depth while speculating; else a few
        requests at the configured shape, ``_few_speculate``) when its verify size, at this batch size, was not
        measured for ``_explore_interval`` steps (the most overdue one). Nothing is priced on the steps where no
        candidate's size is old enough to be due. Exploring only plain decode while speculating left the deeper
        sizes as first measured: at batch 1 a 7-token verify measured at 17.4 ms (really ~13.6) kept the policy at
        chains of 2 for 47 steps, where chains of 6 ran 1.3x faster.

        A size never measured at this batch size is as old as the batch size's curve, but no older than the
        steps since the chosen plan last started or stopped speculating (when it became a candidate): counted
        from the curve alone, the configured depth for everyone was due on the first step that speculated at
        batch 32 (larger random pair, T = 0.8), one 3.3 s step where a plain one took 0.25 s.
        ``prefill``: the step shares prompt chunks; it explores nothing (``_plan_free``) but counts."""
        speculating = any(chosen.shapes)
        self._mode_steps = self._mode_steps + 1 if speculating == self._speculating else 0
        self._speculating = speculating
        if prefill:
            return None
        if speculating:  # plain decode, and the configured depth: sizes above today's go stale too
            cands = [[()] * len(rs), fixed]
        else:
            cands = self._few_speculate(rs, fixed)
        cands = [c for c in cands if c != chosen.shapes]
        pinned = self._pinned_verify()
        nseqs = len(rs) + len(self._pinned)
        sizes = [sum(r.inflight for r in rs) + pinned + sum(self.base.num_nodes(len(s)) for s in c) for c in cands]
        records = [self._cost.verify_record(v, nseqs) for v in sizes]
        records = [r if r.measured or r.age is None else r._replace(age=min(r.age, self._mode_steps))
                   for r in records]
        if all(r.age is not None and r.age < self.explore_min and r.measured for r in records):
            return None  # the common step: no candidate can be due (a measured size's interval is >= explore_min)
        # Priced with the draft's real catch-up: a request that decoded plainly feeds the draft every token since
        # its last round (its whole prefix the first time), and each exploration pays that again. At batch 64 on
        # the larger random pair that was 530-850 ms of the 1.9 s exploration step, 6x a plain step's 0.3 s.
        real = [dataclasses.replace(r, lag=r.catchup, steady=False) for r in rs]
        alternatives = not speculating  # two depths, either of which measures what plain decode lacks
        timed = []  # (interval, age, shapes)
        for c, rec in zip(cands, records, strict=True):
            if rec.age is None:
                return c
            if alternatives or rec.age >= self.explore_min or not rec.measured:
                cost = self.price(real, c)
                steady = self.price(rs, c).rate
                if cost.seconds > self.explore_stall * chosen.seconds and steady < self.explore_floor * chosen.rate:
                    continue  # dear, and only a curve wrong by 1 / explore_floor could make it the better plan
                backoff = 2 ** min(self.explore_backoff, rec.confirms)
                interval = backoff * self._explore_interval(chosen, cost, rec.measured)
                if alternatives and rec.measured:
                    interval /= self._odds(steady, chosen.rate)
                timed.append((min(self.explore_every, interval), rec.age, c))
        if timed and alternatives:  # the one that loses less
            timed = [min(timed, key=lambda t: t[0])]
        due = [(a / max(interval, 1.0), c) for interval, a, c in timed if a >= interval]
        return max(due, key=lambda t: t[0])[1] if due else None

    def _odds(self, rate: float, chosen_rate: float) -> float:
        """While plain decode runs, an exploration's share of the budget: (its plan's steady rate / plain
        decode's) ** explore_odds, at most 1. From plain decode an exploration is a bet that a curve is wrong by
        chosen / rate, and a size already measured at this batch size is rarely that far off: at batch 64 (larger
        random pair, greedy, one 48-token wave a run) a few requests at depth 8 were predicted at ~0.55x plain
        decode's rate; explored every ~70 steps by the budget alone, each one (~2.5 plain steps long with its
        draft's catch-up) left single runs at 0.94x no speculation, the runs without one at 1.01-1.02x (``bench
        compare --lockstep``). Near a tie (0.9x: 0.81 of the budget) it is explored almost as often as before."""
        if chosen_rate <= 0:
            return 1.0
        return max(0.01, min(1.0, rate / chosen_rate)) ** self.explore_odds

    def _few_speculate(self, rs: Sequence[_Req], fixed: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
        """While plain decode runs, the explorations: about as many candidate nodes as chains of 1 for everyone,
        and as half the configured depth for everyone, but carried by the fewest requests (the configured shape,
        cut to what is left, on those whose draft has least to catch up first; the others decode plainly). The
        verify size is what the policy needs measured; every request that speculates first feeds its draft its
        whole prefix. Spread over the batch, a chain-of-4 exploration at batch 32 (larger random pair, T = 0.8)
        fed the draft ~1800 tokens and took ~3 s against 0.35 s for a plain step, and the runs that explored were
        4-11 % slower than no speculation."""
        order = sorted(range(len(rs)), key=lambda i: (rs[i].catchup, i))
        depth = max((len(f) for f in fixed), default=0)
        out: list[list[tuple[int, ...]]] = []
        for target in (len(rs), max(1, len(rs) * depth // 2)):
            shapes: list[tuple[int, ...]] = [()] * len(rs)
            left = target
            for i in order:
                if left <= 0:
                    break
                d = len(fixed[i])
                while d > 1 and branching_nodes(fixed[i][:d]) > left:
                    d -= 1
                shapes[i] = fixed[i][:d]
                left -= branching_nodes(shapes[i])
            if any(shapes) and shapes not in out:
                out.append(shapes)
        return out

    def _explore_interval(self, chosen: _Plan, other: _Plan, measured: bool = True) -> float:
        """Steps between explorations of ``other`` so that they spend ~explore_budget of the time: its step loses
        ``other.seconds - other.tokens / chosen.rate`` against the chosen plan. Pricing by the rate alone (an
        exploration r times slower per token every (r - 1) / budget steps) assumed both steps emit as many tokens:
        at batch 64 a chain-of-4 exploration (1.9 s) was run every 14 steps of plain decode (0.3 s each), 15 % of
        the run. At batch 1 the warm-up's verify of 9 tokens and draft forward had been measured while another
        process ran (35-47 ms and 9 ms, against 17 ms and 2 ms in steady use): plain decode was predicted 1.5x
        faster than a chain of 6 that was really 1.7x faster; a cheap exploration is repeated within tens of
        steps, which corrects such a curve. ``measured``: whether ``other``'s verify size was ever measured at
        this batch size."""
        if chosen.rate <= 0 or chosen.seconds <= 0:
            return self.explore_every
        lost = other.seconds - other.tokens / chosen.rate
        # A size never measured at this batch size is priced from other sizes' curves: explore it as soon as the
        # budget allows (at batch 32, T = 0.8, plain decode was priced 0.25 s from the sampled chains' steps, and
        # really took 0.19 s), without waiting ``explore_min`` steps.
        low = self.explore_min if measured else 0
        budget = self.explore_budget * min(1.0, self.explore_stall * chosen.seconds / max(other.seconds, 1e-9))
        return min(self.explore_every, max(low, lost / (budget * chosen.seconds)))
