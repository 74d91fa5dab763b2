"""The adaptive speculation policy (docs/adaptive.md): the scheduler's ``SpecPolicy`` interface around the
planner, learning from every round (``observe_round``) and timed step (``observe_step``), exploring now and then."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.adaptive.acceptance import AcceptanceTracker, expected_tokens
from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.costs import CostModel, StepTiming, bucket
from scheduler.adaptive.explore import Explorer
from scheduler.adaptive.plan import DRAFT, PLAIN, Plan, Req, plan, price, real_load
from scheduler.adaptive.realized import RealizedRates
from scheduler.adaptive.sources import Sources, choose
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.scheduler import ScheduledBatch
    from scheduler.spec_policy import SpecPolicy


@dataclass
class AdaptivePolicy:
    measures_costs = True  # the engine times its steps for ``observe_step``
    base: SpecPolicy  # the configured tree (K_max = its depth) and the context caps
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    costs: CostModel = field(default_factory=CostModel)  # greedy steps
    sampled_costs: CostModel = field(default_factory=CostModel)  # steps with a sampled round
    acceptance: AcceptanceTracker | None = None
    observing: bool = True  # False: step times are not learned
    forced: tuple[int, ...] | None = None  # every round at this shape (cut to caps): start-up profiling
    sources: Sources | None = None  # a proposer in the controller (and its fallback model), priced per request
    match_acceptance: AcceptanceTracker | None = None  # the proposer's acceptance (``sources``)
    _views: dict[int, Req] = field(default_factory=dict)  # this step's requests as planned
    _last: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> previous chosen shape
    _cold_steps: int = 0
    realized: RealizedRates | None = None  # what planned steps yielded, per source and plain apart
    _step_tokens: int = 0  # tokens this step's rounds emitted so far
    _step_sources: set[str] = field(default_factory=set)  # the sources whose candidates they verified
    _probes: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, source) -> its probes that lost
    _probing: set[str] = field(default_factory=set)  # the vetoed sources this step probes
    _since_probe: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, source) -> steps since probed
    _calm: dict[int, int] = field(default_factory=dict)  # bucket -> steps since a source there was last vetoed

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = AcceptanceTracker(self.config)
        if self.match_acceptance is None:
            self.match_acceptance = AcceptanceTracker(self.config)
        self.costs = dataclasses.replace(self.costs, config=self.config)
        self.sampled_costs = dataclasses.replace(self.sampled_costs, config=self.config)
        self.explorer = Explorer(self.config)
        if self.realized is None:
            self.realized = RealizedRates(self.config)

    # ------------------------------------------------------------------------------ the SpecPolicy interface
    def depth(self, num_tokens: int, remaining_tokens: int) -> int:
        return self.base.depth(num_tokens, remaining_tokens)

    def observe_round(self, req: Request, branching: tuple[int, ...], num_accepted: int) -> None:
        self._step_tokens += num_accepted + 1
        source = self.source_of(req.seq_id)
        if branching:
            self._step_sources.add(source)
        self._tracker(source).observe(req.params.greedy, any(w > 1 for w in branching),
                                                           len(branching), num_accepted)

    def observe_step(self, batch: ScheduledBatch, timing: StepTiming) -> None:
        """A timed step: what the planned step carried (its rounds as viewed when planned, before the counters
        moved, and its prompt chunks) and how long it took."""
        views = [self._views.get(r.seq_id) for r in batch.rounds]
        tokens, drafted, self._step_tokens, self._step_sources = self._step_tokens, self._step_sources, 0, set()
        if not self.observing or None in views:  # a step this policy did not plan is not learned from
            return
        seconds = timing.verify_s + timing.draft_s + timing.state_s
        if self.forced is None and not batch.prefills:
            plain, b = self.realized.rate(len(views), PLAIN), bucket(len(views))
            for s in self._probing & drafted:  # a probe that lost stretches its next interval; one that won resets it
                self._probes[b, s] = self._probes.get((b, s), 0) + 1 if plain and tokens < plain * seconds else 0
            self.realized.observe(len(views), drafted, tokens, seconds)
        load = real_load(views, batch.shapes)
        prefill = sum(c.end - c.start for c in batch.prefills)
        load.verify_tokens += prefill
        load.prefill_tokens, load.num_seqs = prefill, load.num_seqs + len(batch.prefills)
        (self.sampled_costs if load.sampled else self.costs).observe(load, timing)

    def forget(self, seq_id: int) -> None:
        self._last.pop(seq_id, None)

    def reach(self, greedy: bool, depth: int) -> list[float]:
        return self.acceptance.reach(greedy, depth)

    def reset_acceptance(self) -> None:
        """Forget what rounds taught (e.g. the start-up profiling's random prompts); the cost curves stay."""
        self.acceptance = AcceptanceTracker(self.config)
        self.match_acceptance = AcceptanceTracker(self.config)
        self.realized = RealizedRates(self.config)
        self._last.clear()
        self._probes.clear()

    @staticmethod
    def pinned(req: Request) -> bool:
        """A seeded sampled request runs the configured shape every round: its output must not depend on timing."""
        return req.params.seed is not None and not req.params.greedy

    # ------------------------------------------------------------------------------------------- planning
    def plan(self, reqs: Sequence[Request], prefill: bool = False) -> list[tuple[int, ...]]:
        """Each request's round. ``prefill``: prompt chunks share the step (no exploration: its time is theirs)."""
        tree = self.base.tree.branching
        self._probing = set()
        if self.forced is not None:
            self._views = {r.seq_id: self._view(r, []) for r in reqs}
            return [self.forced[: self.base.cap(r)] for r in reqs]
        # A source whose steps have measured slower than plain ones at this batch size drafts nothing whatever
        # the curves predict (its requests take the next-best source, or plain decode); it still runs as a probe
        # when due on its own timer (what a step of it loses sets how often, stretched while its probes keep
        # losing), so a workload that starts accepting more is seen. With every source vetoed, the opening rounds
        # done and nothing pinned, plain decode without planning (its ~1 ms a step shows at batch 1).
        n, b = len(reqs), bucket(len(reqs))
        names = self._source_names()
        vetoed, probing = set(), set()
        for s in names:
            loss = self.realized.loss(n, s)
            self._since_probe[b, s] = self._since_probe.get((b, s), 0) + 1
            if loss <= 0:
                self._probes.pop((b, s), None)
            elif prefill or self._since_probe[b, s] <= self._probe_interval(loss, n, s):
                vetoed.add(s)
            else:
                probing.add(s)
        self._calm[b] = 0 if vetoed or probing else self._calm.get(b, 1 << 30) + 1
        everything = len(vetoed) == len(names)
        if everything and self._opened(reqs):
            self._views = {r.seq_id: self._view(r, []) for r in reqs}
            self._last.update((r.seq_id, ()) for r in reqs)
            return [()] * n
        pins = self._pins(reqs)
        costs = self._costs_for([r.params.greedy for r in reqs])
        views = self._views_of(reqs, pins, costs, vetoed)
        self._views = {v.seq_id: v for v in views}
        fixed = [tree[: v.cap] for v in views]
        if all(v.pinned is not None for v in views):
            return [v.pinned for v in views]
        if not costs.ready:
            return self._cold(views, fixed)
        if everything:
            plain = [v.pinned or () for v in views]
            self._last.update((v.seq_id, s) for v, s in zip(views, plain, strict=True))
            return plain
        best = plan(views, costs, tree, self.config, self._last)
        self._last.update((v.seq_id, s) for v, s in zip(views, best.shapes, strict=True))
        if vetoed or probing:  # a probe of what the planner would run (plain decode too: its answer is the probe)
            for s in probing:
                self._since_probe[b, s] = 0
            self._probing = {v.source for v, sh in zip(views, best.shapes, strict=True) if sh} & probing
            return best.shapes
        return (self._exploration(views, best, fixed, costs, prefill) or best).shapes

    def _probe_interval(self, loss: float, num_seqs: int, source: str) -> float:
        """Steps between probes of a vetoed source: the exploration budget's, times ``probe_backoff`` per probe of
        it that lost since one last won (up to ``probe_every``)."""
        c = self.config
        stretch = c.probe_backoff ** self._probes.get((bucket(num_seqs), source), 0)
        return min(float(max(c.probe_every, c.explore_min)), self.explorer.interval(loss) * stretch)

    def _opened(self, reqs: Sequence[Request]) -> bool:
        """No request pinned: none seeded and sampled, and each regime present past its opening rounds."""
        seen, need = self.acceptance.seen_rounds, self.config.min_rounds if self._opens else 0
        return not any(self.pinned(r) or seen(r.params.greedy) < need for r in reqs)

    @property
    def _opens(self) -> bool:
        """Opening rounds measure a draft model (a proposer is free to try: it measures itself)."""
        return self.sources is None or self.sources.fallback_depth > 0

    def _source_names(self) -> list[str]:
        """The sources rounds may be drafted from: the draft model, or the proposer (and its fallback model)."""
        src = self.sources
        return [DRAFT] if src is None else [src.name] + ([DRAFT] if src.fallback_depth else [])

    def source_of(self, seq_id: int) -> str:
        """The source this step's plan gave the request's candidates (``DRAFT`` when no proposer is configured)."""
        v = self._views.get(seq_id)
        return v.source if v is not None else DRAFT

    def _tracker(self, source: str) -> AcceptanceTracker:
        return self.match_acceptance if self.sources is not None and source == self.sources.name else self.acceptance

    def _views_of(self, reqs: Sequence[Request], pins: list[tuple[int, ...] | None], costs: CostModel,
                  vetoed: set[str]) -> list[Req]:
        """Each request as planned: from the draft's rates, or with ``sources`` the view of the source it is best
        drafted from (sources.py) among those not ``vetoed`` (a pinned request ignores the veto: a seeded sampled
        one takes the proposer wherever it has a match, as its output must not depend on timing)."""
        tree = self.base.tree.branching
        memo: dict[tuple[str, bool], tuple[list[float], list[float] | None]] = {}

        def rates(source: str, greedy: bool) -> tuple[list[float], list[float] | None]:
            if (source, greedy) not in memo:
                t = self._tracker(source)
                memo[source, greedy] = (t.rates(greedy, len(tree)),
                                        t.rates(greedy, len(tree), tree) if any(w > 1 for w in tree) else None)
            return memo[source, greedy]

        src = self.sources
        if src is None:
            return [self._view(r, *rates(DRAFT, r.params.greedy), p) for r, p in zip(reqs, pins, strict=True)]
        views = []
        for r, p in zip(reqs, pins, strict=True):
            cap, g = self.base.cap(r), r.params.greedy
            depth = min(cap, src.match(r, cap)) if cap else 0
            free = p is None
            options = []
            if depth and not (free and src.name in vetoed):
                pin = p if self.pinned(r) else None  # opening rounds are the draft model's
                options.append(dataclasses.replace(self._view(r, *rates(src.name, g), pin, cap=depth),
                                                   source=src.name, forwards=False))
            if src.fallback_depth and not (options and self.pinned(r)) and not (free and DRAFT in vetoed):
                options.append(self._view(r, *rates(DRAFT, g), p, cap=min(cap, src.fallback_depth)))
            views.append(choose(options, costs, self.config) if options
                         else self._view(r, *rates(DRAFT, g), None, cap=0))
        return views

    def _view(self, r: Request, rates: list[float], tree_rates: list[float] | None = None,
              pin: tuple[int, ...] | None = None, cap: int | None = None) -> Req:
        cap = self.base.cap(r) if cap is None else cap
        pin = pin[:cap] if pin is not None else None
        catchup = max(1, r.num_tokens - r.num_cached_draft)
        inflight = max(1, r.num_tokens - r.num_cached_target)
        if not rates:  # forced shapes: only the step's accounting is needed
            return Req(r.seq_id, cap, inflight, catchup, [], greedy=r.params.greedy)
        rates = rates[:cap]
        if tree_rates is not None and not any(w > 1 for w in self.base.tree.branching[:cap]):
            tree_rates = None
        remaining = min(r.remaining_tokens, self.base.max_model_len - r.num_tokens)
        # The catch-up is paid once: priced spread over the rounds the request has left if it speculates now.
        lag = 1.0
        if catchup > 1 and remaining > 0:
            lag += (catchup - 1) * min(1.0, expected_tokens(rates, cap) / remaining)
        return Req(r.seq_id, cap, inflight, catchup, rates, tree_rates, lag, r.params.greedy, pin)

    def _pins(self, reqs: Sequence[Request]) -> list[tuple[int, ...] | None]:
        """Seeded sampled requests at the configured shape, and in a regime with fewer than ``min_rounds`` rounds
        seen, just enough of the others to see them this step at the opening chain of ``open_depth`` (cheap where
        speculation loses; deeper positions start from the measured ones' rates); the rest are planned."""
        tree = self.base.tree.branching
        pin = [tree[: self.base.cap(r)] if self.pinned(r) else None for r in reqs]
        need = {g: self.config.min_rounds - self.acceptance.seen_rounds(g) if self._opens else 0 for g in (False, True)}
        for r, p in zip(reqs, pin, strict=True):
            need[r.params.greedy] -= p is not None
        opening = (1,) * max(1, self.config.open_depth)
        for i, r in enumerate(reqs):
            if pin[i] is None and need[r.params.greedy] > 0:
                pin[i] = opening[: self.base.cap(r)]
                need[r.params.greedy] -= 1
        return pin

    def _costs_for(self, greedy: Sequence[bool]) -> CostModel:
        return self.sampled_costs if not all(greedy) and self.sampled_costs.ready else self.costs

    def _cold(self, views: list[Req], fixed: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """While the curves cannot price a plan: pinned rounds, else plain decode and a few requests at the
        configured shape in turn (what measures the curves, stalling the batch least)."""
        plain = [v.pinned or () for v in views]
        self._cold_steps += 1
        return plain if any(plain) or self._cold_steps % 2 else self._few_speculate(views, fixed)

    def _few_speculate(self, views: Sequence[Req], fixed: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """As many candidate nodes as chains of half the configured depth for every free request, carried by the
        fewest (least draft to catch up): the verify size is what needs measuring, and every request that first
        speculates feeds its draft its whole prefix."""
        free = sorted((i for i, v in enumerate(views) if v.pinned is None), key=lambda i: (views[i].catchup, i))
        shapes = [v.pinned or () for v in views]
        left = max(1, len(free) * max((len(f) for f in fixed), default=0) // 2)
        for i in free:
            if left <= 0:
                break
            d = len(fixed[i])
            while d > 1 and _nodes(fixed[i][:d]) > left:
                d -= 1
            shapes[i] = fixed[i][:d]
            left -= _nodes(shapes[i])
        return shapes

    def _exploration(self, views: list[Req], chosen: Plan, fixed: list[tuple[int, ...]], costs: CostModel,
                     prefill: bool) -> Plan | None:
        """One step of a plan not in use (plain decode or the configured shape while speculating; else a few
        requests at the configured shape) when its verify size, at this batch size, is due by the budget."""
        if prefill:
            return None
        speculating = any(s for v, s in zip(views, chosen.shapes, strict=True) if v.pinned is None)
        # The configured shape waits ``probe_every`` steps after a source at this batch size was last vetoed: right
        # after a veto lifts, speculation is near break-even and its largest verify is the costliest thing to try.
        calm = self._calm.get(bucket(len(views)), 0) >= self.config.probe_every
        cands = ([[v.pinned or () for v in views]] + ([fixed] if calm else []) if speculating
                 else [self._few_speculate(views, fixed)] if calm else [])
        due = []
        for c in cands:
            if c == chosen.shapes:
                continue
            age, measured = costs.size_record(real_load(views, c).verify_tokens, len(views))
            real = price(views, c, costs, steady=False)
            if age is None:
                return real
            loss = (real.seconds - real.tokens / chosen.rate) / chosen.seconds if chosen.rate > 0 else math.inf
            interval = self.explorer.interval(loss, measured)
            if age >= interval:
                due.append((age / max(interval, 1.0), real))
        return max(due, key=lambda t: t[0])[1] if due else None


def _nodes(shape: tuple[int, ...]) -> int:
    return sum(math.prod(shape[: i + 1]) for i in range(len(shape)))
