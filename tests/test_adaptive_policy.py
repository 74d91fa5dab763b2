"""The adaptive speculation policy's behaviour on hand-made inputs (scheduler/adaptive/): the planner against a
brute-force search over the same menu, acceptance estimates, exploration and hysteresis as observable choices."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler.adaptive import AdaptiveConfig, AdaptivePolicy
from scheduler.adaptive.acceptance import AcceptanceTracker, expected_tokens
from scheduler.adaptive.costs import CostModel, Curve, StepLoad, StepTiming
from scheduler.adaptive.explore import Explorer
from scheduler.adaptive.plan import DRAFT, PLAIN, Req, best_chains, plan, price, real_load
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import SpecPolicy, TreeShape
from tests.helpers_adaptive import decoding_requests

MS = 1e-3


def _curve(fn, xs=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> Curve:
    c = Curve()
    for x in xs:
        c.observe(x, fn(x))
    return c


def _costs(verify_ms_per_token: float, verify_fixed_ms: float, draft_ms_per_token: float,
           draft_fixed_ms: float) -> CostModel:
    return CostModel(verify=_curve(lambda n: (verify_fixed_ms + verify_ms_per_token * n) * MS),
                     draft=_curve(lambda n: (draft_fixed_ms + draft_ms_per_token * n) * MS),
                     state=_curve(lambda n: 0.0))


EXACT = AdaptiveConfig(spec_margin=0.0, hysteresis=0.0)


def _brute_force(reqs: list[Req], costs: CostModel, tree: tuple[int, ...]):
    """Every assignment of chains 0 .. cap per request, and the configured tree for everyone: the best rate."""
    menu = [[(1,) * d for d in range(r.cap + 1)] for r in reqs]
    best = max((price(reqs, list(shapes), costs) for shapes in itertools.product(*menu)), key=lambda p: p.rate)
    if any(w > 1 for w in tree):
        t = price(reqs, [tree[: r.cap] for r in reqs], costs)
        best = max(best, t, key=lambda p: p.rate)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_planner_finds_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    costs = _costs(rng.choice([0.01, 0.3, 2.0]), rng.uniform(5, 30), rng.uniform(0.01, 0.5), rng.uniform(0.5, 5))
    tree = (2, 1, 1) if seed % 2 else (1, 1, 1)
    reqs = [Req(i, cap=rng.randint(0, 3), inflight=1, catchup=1, rates=[rng.uniform(0.3, 0.95)] * 3,
                tree_rates=[rng.uniform(0.5, 0.98)] * 3 if seed % 2 else None, lag=1.0)
            for i in range(rng.randint(1, 4))]
    got = plan(reqs, costs, tree, EXACT)
    best = _brute_force(reqs, costs, tree)
    assert got.rate >= best.rate * 0.98, (got.shapes, got.rate, best.shapes, best.rate)
    assert [r.source for r in got.rounds] == [DRAFT if s else PLAIN for s in got.shapes]


def test_memory_bound_speculates_deep_and_compute_bound_decodes_plainly() -> None:
    reqs = [Req(i, cap=4, inflight=1, catchup=1, rates=[0.9] * 4, lag=1.0) for i in range(4)]
    memory_bound = best_chains(reqs, _costs(0.0, 20, 0.01, 0.1), EXACT)
    assert memory_bound.shapes == [(1,) * 4] * 4
    compute_bound = best_chains(reqs, _costs(5.0, 0, 3.0, 1.0), EXACT)
    assert compute_bound.shapes == [()] * 4
    # A pinned request keeps its shape whatever the costs.
    pinned = [Req(9, 4, 1, 1, [0.9] * 4, lag=1.0, pinned=(1, 1))] + reqs
    assert best_chains(pinned, _costs(5.0, 0, 3.0, 1.0), EXACT).shapes[0] == (1, 1)


def test_margin_and_hysteresis_keep_near_ties() -> None:
    reqs = [Req(0, cap=2, inflight=1, catchup=1, rates=[0.5, 0.5], lag=1.0)]
    costs = _costs(0.0, 10, 0.2, 0.8)
    exact = plan(reqs, costs, (1, 1), EXACT)
    plain = price(reqs, [()], costs)
    assert exact.speculates and exact.rate < plain.rate * 1.5
    margin = AdaptiveConfig(spec_margin=exact.rate / plain.rate - 1 + 0.01)
    assert not plan(reqs, costs, (1, 1), margin).speculates  # not enough better than plain decode
    # The previous step's shapes stay unless the new best beats them by the hysteresis.
    sticky = AdaptiveConfig(spec_margin=0.0, hysteresis=0.5)
    assert plan(reqs, costs, (1, 1), sticky, previous={0: ()}).shapes == [()]


def test_the_plan_states_the_step_token_accounting() -> None:
    reqs = [Req(0, cap=3, inflight=2, catchup=5, rates=[0.8] * 3, lag=1.5), Req(1, 3, 1, 1, [0.8] * 3, lag=1.0)]
    load = real_load(reqs, [(2, 1, 1), ()])
    # target: in-flight 2 + 1, tree nodes 2 + 2 + 2; draft: forward 0 carries the catch-up, 1 and 2 a level each
    assert (load.verify_tokens, load.forward_tokens, load.forward_seqs, load.num_seqs) == (9, [5, 2, 2], [1, 1, 1], 2)
    assert price(reqs, [(2, 1, 1), ()], _costs(0.1, 1, 0.1, 1)).load == load


def test_acceptance_learns_per_regime_and_forgets_unreached_depths() -> None:
    t = AcceptanceTracker()
    assert t.rates(True, 3) == pytest.approx([0.7] * 3)
    for _ in range(100):
        t.observe(True, False, 4, 4)  # greedy chains: every candidate accepted
    assert all(r > 0.9 for r in t.rates(True, 4)) and t.rates(False, 2) == pytest.approx([0.7] * 2)
    assert t.rates(True, 6)[5] == pytest.approx(t.rates(True, 6)[3], abs=0.02)  # untried: as above
    reach = t.reach(True, 3)
    assert reach[0] > 0.9 and reach[0] >= reach[1] >= reach[2]
    for _ in range(20):
        t.observe(True, False, 4, 1)  # misses at depth 2 ...
    low = t.rates(True, 4)[1]
    for _ in range(500):
        t.observe(True, False, 1, 1)  # ... then rounds that stop at depth 1: depth 2's miss ages away
    assert t.rates(True, 4)[1] > low + 0.1
    # A tree's prior is the chain's rate; its own rounds move it.
    assert t.rates(True, 2, (2, 1)) == pytest.approx(t.rates(True, 2))
    assert t.seen_rounds(True) == 620 and t.seen_rounds(False) == 0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_explorer_budget_and_hysteresis() -> None:
    cfg = AdaptiveConfig()
    e = Explorer(cfg)
    assert e.interval(0.0) == cfg.explore_min
    assert e.interval(0.0, measured=False) == 0  # never measured: as soon as possible
    assert e.interval(0.0, steps=3) == 3 * cfg.explore_min  # a burst of 3 steps: 3 times as far apart
    assert e.interval(1.0) == pytest.approx(1.0 / cfg.explore_budget)  # one step lost every 1 / budget steps
    assert e.interval(100.0) == cfg.explore_every
    assert e.beats(1.06, 1.0) and not e.beats(1.04, 1.0)
    with pytest.raises(ValueError):
        AdaptiveConfig(explore_budget=0.0)
    with pytest.raises(ValueError):
        AdaptiveConfig(explore_min=300)




def _true_seconds(load: StepLoad, verify_ms: float, draft_ms: float) -> StepTiming:
    """A machine whose target costs ``verify_ms`` a step plus 0.2 ms a token, and the draft ``draft_ms`` a token."""
    fwd = [draft_ms * n * MS for n in load.forward_tokens if n > 0]
    return StepTiming((verify_ms + 0.2 * load.verify_tokens) * MS, sum(fwd), 0.0, draft_forward_s=fwd)


def _run(policy: AdaptivePolicy, reqs: list[Request], steps: int, verify_ms: float, draft_ms: float,
         accepted: int) -> list[list[tuple[int, ...]]]:
    chosen = []
    for _ in range(steps):
        shapes = policy.plan(reqs)
        batch = ScheduledBatch(rounds=reqs, shapes=[tuple(s) for s in shapes])
        for r, s in zip(reqs, shapes, strict=True):
            policy.observe_round(r, s, min(accepted, len(s)))
        policy.observe_step(batch, _true_seconds(real_load([policy._views[r.seq_id] for r in reqs], shapes),
                                                 verify_ms, draft_ms))
        chosen.append(shapes)
    return chosen


def test_the_policy_learns_to_speculate_and_explores_within_its_budget() -> None:
    policy = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 4), 4096, 4096))
    reqs = decoding_requests(4)
    # Memory-bound target (30 ms a step), cheap draft, every candidate accepted: deep chains win.
    steps = _run(policy, reqs, 300, verify_ms=30.0, draft_ms=1.0, accepted=4)
    late = steps[100:]
    assert sum(all(len(s) == 4 for s in st) for st in late) >= 0.9 * len(late)
    # Explorations are the minority: plain decode is re-measured now and then, within a few budgets.
    plain = sum(not any(st) for st in late)
    assert 0 < plain <= 0.1 * len(late)


def test_the_policy_stops_speculating_when_nothing_is_accepted() -> None:
    policy = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 4), 4096, 4096))
    reqs = decoding_requests(4)
    steps = _run(policy, reqs, 200, verify_ms=30.0, draft_ms=8.0, accepted=0)
    late = steps[100:]
    assert sum(not any(st) for st in late) >= 0.85 * len(late)


def test_seeded_sampled_requests_are_pinned_to_the_configured_shape() -> None:
    policy = AdaptivePolicy(SpecPolicy(TreeShape((2, 1, 1)), 4096, 4096))
    reqs = decoding_requests(3, greedy=False)
    reqs[0].params = SamplingParams(max_tokens=10_000, temperature=1.0, seed=7, ignore_eos=True)
    steps = _run(policy, reqs, 60, verify_ms=5.0, draft_ms=20.0, accepted=0)  # speculation cannot pay
    assert all(st[0] == (2, 1, 1) for st in steps)
    assert sum(not st[1] for st in steps[30:]) >= 25


def test_the_policys_config_sets_how_far_a_measurement_moves_its_cost_curves() -> None:
    """curve_decay / curve_max_jump reach every curve of the policy's cost models, the ones made later too."""
    load = StepLoad(verify_tokens=8, num_seqs=8)

    def verify_after_a_slow_step(config: AdaptiveConfig) -> float:
        policy = AdaptivePolicy(SpecPolicy(TreeShape((1, 1)), 4096, 4096), config=config)
        for seconds in (0.010, 0.010, 0.030):  # two steady steps, then one three times slower
            policy.costs.observe(load, StepTiming(verify_s=seconds, draft_s=0.0, state_s=0.0))
        return policy.costs.verify_seconds(8, 8)

    assert verify_after_a_slow_step(AdaptiveConfig()) == pytest.approx(0.012)  # curve_decay 0.1 of the way
    assert verify_after_a_slow_step(AdaptiveConfig(curve_decay=0.8)) == pytest.approx(0.020)  # max_jump 0.5 caps it
    assert verify_after_a_slow_step(AdaptiveConfig(curve_decay=1.0, curve_max_jump=1.0)) == pytest.approx(0.030)


def test_a_plan_prices_each_forward_once_and_never_keeps_a_stale_price(monkeypatch) -> None:
    """While a plan is made each price is computed once per argument (at 8 requests the planner re-priced the same
    forwards ~300 times a step); after it, a changed curve changes the next plan's prices."""
    costs = _costs(0.3, 10.0, 0.2, 2.0)
    reqs = [Req(i, cap=8, inflight=1, catchup=40, rates=[0.6] * 8, lag=None) for i in range(8)]
    calls: list[tuple[float, int]] = []
    inner = CostModel._draft_forward
    monkeypatch.setattr(CostModel, "_draft_forward", lambda self, n, q: calls.append((n, q)) or inner(self, n, q))
    first = plan(reqs, costs, (1,) * 8, EXACT)
    assert calls and len(calls) == len(set(calls))
    for _ in range(50):  # the verify curve doubles (each observation moves a point part of the way)
        for x in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            costs.verify.observe(x, 2 * costs.verify(x))
    assert price(reqs, first.shapes, costs).seconds > 1.3 * first.seconds
    assert plan(reqs, costs, (1,) * 8, EXACT).seconds > 1.3 * first.seconds
