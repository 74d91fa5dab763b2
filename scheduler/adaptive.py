"""Adaptive speculation: each step, the depth and shape of every request's round, by measured costs (stdlib only).

The goal is the batch's expected emitted tokens per second:

    E[tokens] / step seconds,  E[tokens] = sum_i (1 + sum_{j<k_i} prod_{m<=j} alpha_im)

with alpha from scheduler/acceptance.py (each request's own rounds, the engine-wide rates of its sampling
regime as the prior) and step seconds from scheduler/cost_model.py (verify vs batched tokens, one draft forward
vs its tokens, controller time vs requests; all measured).

The plan's pricing and its search (the best chains by value under each depth cap, the configured tree per
request) are scheduler/plan_search.py's.

Stability: the previous step's choice, re-priced with today's estimates, stays unless the new one is better by
``hysteresis`` (relative); noise in the estimates does not flip the depth every step.

Exploration keeps the cost curves current (scheduler/exploration.py): now and then one step runs a plan the
policy is not using, to measure its size again. The engine seeds both curves at start-up with a few steps of
dummy sequences over depths and batch sizes (engine/core/policy_warmup.py, through ``forced``); until they can price a
plan, plain decode and a few requests at the configured shape take turns (``_cold``).

Reproducibility: greedy output never depends on any of this (the depth never changes a greedy token), and
unseeded sampled output keeps the target's law at every depth. A *seeded* sampled request's tokens depend on the
depths its rounds ran (the draws are consumed differently), so it is pinned to the configured shape: the same
seed gives the same output whatever the load and the measured costs. The others are planned around it (its
tokens are priced in the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.acceptance import AcceptanceTracker, expected_tokens
from scheduler.cost_model import CostModel, Curve, StepSample
from scheduler.exploration import Exploration
from scheduler.plan_search import PlanSearch, _Plan, _Req
from scheduler.request import Request
from scheduler.spec_policy import SpecPolicy


@dataclass
class _Lead:
    """Plain decode's lead at a batch bucket and regime (``AdaptivePolicy.clear_lead``)."""

    steps: int  # steps left that may skip the search
    spec_rate: float  # the best speculating rate the search found, per sequence: what plain decode must stay ahead of


@dataclass
class AdaptivePolicy(PlanSearch, Exploration):
    measures_costs = True  # learns its cost curves from every step's measured times (observe_step)
    base: SpecPolicy  # the configured tree (K_max = its depth) and the context caps
    cost: CostModel = field(default_factory=CostModel)  # steps of greedy requests only
    # Steps with sampled requests cost more per node (their draft laws travel to the verifier, and verification
    # samples residuals): their own curves, used once measured (the greedy ones until then).
    sampled_cost: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    hysteresis: float = 0.03  # a new plan must beat the previous one by this much (relative)
    # Rounds of a sampling regime the engine must have seen before its requests are planned: until then they run
    # the configured shape. A policy that plans from the default prior alone may choose K = 0 and then never
    # measures the acceptance that would have made speculation pay.
    min_rounds: int = 8
    observing: bool = True  # False: step times are not learned (the start-up profiling's first steps)
    # Where plain decode beat every speculating plan by more than ``clear_lead`` (relative), the next
    # ``clear_steps`` steps of that batch size and regime decode plainly without the search. At saturation the
    # search was most of the controller's time: ~3 ms a step at batch 64 (K_max 8, 512 candidates under 8
    # depth caps) of a 0.45-0.55 s step, to choose plain decode again (the lead there, on the curves a c64
    # server measured: 8-9 %). Speculating must also win by ``spec_margin``, so such a lead closes only on a
    # ~10 % move of the estimates, not in a few steps unless the batch changes, which plans again at once.
    # Explorations go on as before. The lead is held only while plain decode's own price keeps it: a plain step
    # measured dearer than its curve said (the start-up profiling's points are short contexts; at concurrency 32,
    # T = 0.8, built-in pair, batch 32's plain step was priced at 23 ms and took 69) searches again at once. Held
    # on the lead it was set with, plain decode ran 4 more steps at 0.58-0.80 tokens/ms where the chains it had
    # priced below it ran ~0.85.
    clear_lead: float = 0.05
    clear_steps: int = 4
    _clear: dict[tuple[int, bool], _Lead] = field(default_factory=dict)  # (batch bucket, sampled) -> its lead
    _last: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> previous (non-exploring) shape
    _cold_steps: int = 0  # steps planned before the curves could price a plan (``_cold``)
    forced: tuple[int, ...] | None = None  # every round at this shape (cut to caps): the start-up profiling
    _cost: CostModel | None = None  # the curves of this step's regime (set by ``plan``)
    _pinned: list[tuple[_Req, tuple[int, ...]]] = field(default_factory=list)  # this step's fixed-shape rounds

    # --------------------------------------------------------------------------------- SpecPolicy interface
    def depth(self, num_tokens: int, remaining_tokens: int) -> int:
        return self.base.depth(num_tokens, remaining_tokens)

    def num_nodes(self, depth: int) -> int:
        return self.base.num_nodes(depth)

    def cap(self, req: Request) -> int:
        return self.base.cap(req)

    def observe_round(self, req: Request, branching: tuple[int, ...], num_accepted: int) -> None:
        tree = any(w > 1 for w in branching)
        self.acceptance.observe(req.seq_id, req.params.greedy, tree, len(branching), num_accepted)

    def observe_step(self, sample: StepSample) -> None:
        if not self.observing:
            return
        (self.sampled_cost if sample.sampled else self.cost).observe(sample)

    def _regime_cost(self, rs: Sequence[_Req]) -> CostModel:
        if any(not r.greedy for r in rs) and self.sampled_cost.ready:
            self.sampled_cost.fallback = self.cost  # its batch sizes where the sampled curves have none
            return self.sampled_cost
        return self.cost

    def forget(self, seq_id: int) -> None:
        self.acceptance.forget(seq_id)
        self._last.pop(seq_id, None)

    @staticmethod
    def pinned(req: Request) -> bool:
        """A seeded sampled request runs the configured shape every round: its output must not depend on timing."""
        return req.params.seed is not None and not req.params.greedy

    def plan(self, reqs: Sequence[Request], prefill: bool = False) -> list[tuple[int, ...]]:
        # A prompt chunk in the same step is not priced (the policy is not told of it): the plan is the one for a
        # decode-only step. Priced beside the rounds, the prefill's seconds (which emit nothing) sat in every plan's
        # denominator, so any candidate with a positive rate raised the step's: at batch 64, T=0.8 (long prompts,
        # chunked) 24-54 decoding requests ran K = 7-8 in each of the 4 prefill steps, which took 3.3-6.2 s against
        # 2.1 s for the same 2048 tokens without them (their candidates also take the token budget from the
        # prompts, delaying them).
        if self.forced is not None:
            return [self.forced[: self.base.cap(r)] for r in reqs]
        k = self.base.tree.depth
        priors = {g: self.acceptance.engine_rates(g, k) for g in (False, True)}
        views = [self._view(r, priors[r.params.greedy]) for r in reqs]
        fixed = [self.base.tree.branching[: v.cap] for v in views]
        self._cost = self._regime_cost(views)
        pin = self._pins(reqs)
        self._pinned = [(v, f) for v, f, p in zip(views, fixed, pin, strict=True) if p]
        rs = [v for v, p in zip(views, pin, strict=True) if not p]
        if not rs:
            return fixed
        free_fixed = [f for f, p in zip(fixed, pin, strict=True) if not p]
        chosen = self._plan_free(rs, free_fixed, prefill) if self._cost.ready else self._cold(rs, free_fixed)
        it = iter(chosen)
        return [f if p else next(it) for f, p in zip(fixed, pin, strict=True)]

    def _pins(self, reqs: Sequence[Request]) -> list[bool]:
        """Which rounds run the configured shape: seeded sampled requests, and in a regime with fewer than
        ``min_rounds`` rounds seen, just enough of the others to see them this step. Pinning every request of a
        new regime cost one step of 32 x K_max candidates at batch 32 (460 ms, 10 % of a short benchmark run,
        where the planned step took 80-250 ms); the rest are planned from the prior and see their own rates
        from the next step on."""
        pin = [self.pinned(r) for r in reqs]
        need = {g: self.min_rounds - self.acceptance.seen_rounds(g) for g in (False, True)}
        for r, p in zip(reqs, pin, strict=True):
            if p:  # its rounds run the configured shape anyway: they count towards the regime's
                need[r.params.greedy] -= 1
        for i, r in enumerate(reqs):
            if not pin[i] and need[r.params.greedy] > 0:
                pin[i] = True
                need[r.params.greedy] -= 1
        return pin

    def _cold(self, rs: list[_Req], fixed: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Shapes while the step's curves cannot price a plan (fewer than two verify sizes, or no draft forward):
        what measures them, stalling the batch least. Where pinned rounds speculate, they measure a speculative
        size and the draft, and the others decode plainly; else plain decode and a few requests at the configured
        shape (``_few_speculate``, about half the configured depth's candidates for the batch) take turns.

        Running the configured depth for everyone until then (as this did) is the dearest step there is at
        saturation: at concurrency 32 on the larger random pair, on a machine where the start-up profiling's
        3 s measured nothing but batch 1's plain step, the first 12 steps ran depth 8 for all 32 requests,
        3-4.2 s each against 0.6 s for a plain one: a third of a two-minute run."""
        if any(shape for _, shape in self._pinned):
            return [()] * len(rs)
        self._cold_steps += 1
        turns = self._few_speculate(rs, fixed) if self._cold_steps % 2 == 0 else []
        return turns[-1] if turns else [()] * len(rs)  # none when no request has room to speculate

    def _plan_free(self, rs: list[_Req], fixed: list[tuple[int, ...]], prefill: bool = False
                   ) -> list[tuple[int, ...]]:
        """Shapes of the requests the policy may choose for (the pinned ones are priced in ``self._pinned``).
        No exploration in a step that prompt chunks share (``prefill``): its time is mostly theirs, so it measures
        a prefill-sized call, not the decode size explored. At concurrency 64 (larger random pair, greedy, waves of
        equal-length requests) the step that admitted 56 new requests was also the one where the 8 left decoding
        made a batch size due for exploration: ~1 s more on a 6 s step, every wave, and the size still unmeasured."""
        nseqs = len(rs) + len(self._pinned)
        clear = (Curve.bucket(nseqs), self._cost is self.sampled_cost)
        if not self._cost.knows_batch_size(nseqs):
            # Plain decode measures this batch size's first sizes; an exploration (a few requests speculating)
            # its second, as soon as the budget allows (a size never measured here is not held to explore_min).
            best = self.price(rs, [()] * len(rs))
        elif (held := self._held_lead(clear, rs, nseqs)) is not None:
            self._clear[clear].steps -= 1
            best = held
        else:
            self._clear.clear()  # another batch size or regime: its lead is not this one's
            best = self.best_chains(rs)
            spec_rate = self.spec_rate
            for other in (self._trees_where_they_pay(rs, best), self._tree_plan(rs)):
                if other is not None:
                    spec_rate = max(spec_rate, other.rate)
                if other is not None and other.rate > best.rate:
                    best = other
            prev = self._previous(rs, best.shapes)
            if prev is not None and best.rate < prev.rate * (1 + self.hysteresis):
                best = prev
            if not any(best.shapes) and not self._pinned and spec_rate < best.rate * (1 - self.clear_lead):
                self._clear[clear] = _Lead(self.clear_steps, spec_rate / nseqs)
        for r, shape in zip(rs, best.shapes, strict=True):
            self._last[r.seq_id] = shape
        explore = self._exploration(rs, best, fixed, prefill)
        if explore is not None:
            self.explored_steps += 1
            return explore
        return best.shapes

    def _held_lead(self, key: tuple[int, bool], rs: list[_Req], nseqs: int) -> _Plan | None:
        """Plain decode, if this step keeps a lead an earlier search set (``clear_lead``): steps of it left, no
        pinned rounds, and plain decode, priced on its curve as measured since, still that far ahead of the
        speculating rate the search found (per sequence: the batch may have moved inside its bucket)."""
        lead = self._clear.get(key)
        if lead is None or lead.steps <= 0 or self._pinned:
            return None
        plain = self.price(rs, [()] * len(rs))
        return plain if plain.rate / nseqs * (1 - self.clear_lead) >= lead.spec_rate else None

    # --------------------------------------------------------------------------------------------- the plan
    def _view(self, r: Request, prior: list[float]) -> _Req:
        cap = self.base.cap(r)
        rates = self.acceptance.rates(r.seq_id, r.params.greedy, cap, prior=prior)
        catchup = max(1, r.num_tokens - r.num_cached_draft)
        remaining = min(r.remaining_tokens, self.base.max_model_len - r.num_tokens)
        return _Req(r.seq_id, r.params.greedy, cap, max(1, r.num_tokens - r.num_cached_target),
                    self._amortized_lag(catchup, rates, remaining), rates, catchup)

    @staticmethod
    def _amortized_lag(catchup: int, rates: list[float], remaining: int) -> float:
        """The draft tokens a round is priced to feed before its tree: one, plus the catch-up (every token since the
        request last speculated; its whole prefix the first time) spread over the rounds the request has left if
        it speculates from now on (its remaining tokens / the tokens a round at its cap is expected to emit).

        The catch-up is paid once, so pricing all of it every round would make a request that stopped
        speculating look ever dearer to restart; pricing none of it (as this did) made restarting look free: at
        concurrency 64 (larger random pair, T = 0.8, 48-token outputs) a step 25 tokens into a wave put all 64
        requests on chains of 1, predicted 5 % faster than plain decode at 0.74 s; its draft fed 3543 tokens, not
        64, and it took 2.3 s."""
        if catchup <= 1 or remaining <= 0:
            return 1.0
        per_round = expected_tokens(rates, len(rates))
        return 1.0 + (catchup - 1) * min(1.0, per_round / remaining)

    def _previous(self, rs: Sequence[_Req], new: list[tuple[int, ...]]) -> _Plan | None:
        """Last step's shapes (cut to today's caps; new requests take the new plan's), re-priced."""
        if not any(r.seq_id in self._last for r in rs):
            return None
        shapes = [self._last[r.seq_id][: r.cap] if r.seq_id in self._last else s for r, s in zip(rs, new, strict=True)]
        if shapes == new:
            return None
        return self.price(rs, shapes)
