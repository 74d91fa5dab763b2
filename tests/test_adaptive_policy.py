"""The adaptive speculation policy with hand-made cost models and acceptance histories (no models, no torch).

Properties: memory-bound costs -> long chains; verify cost linear in tokens -> K = 0; a request whose draft
disagrees gets a shorter chain than one whose draft agrees, in the same batch; the configured tree only where
its measured acceptance pays; the choice does not flap on noisy measurements (and does without hysteresis).
"""

from __future__ import annotations

import collections
import math
import random

import pytest

from scheduler.acceptance import AcceptanceTracker, expected_tokens
from scheduler.adaptive import AdaptivePolicy
from scheduler.cost_model import CostModel, Curve, StepSample, monotone
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.spec_policy import BatchSizeSchedule, SpecPolicy, TreeShape

K_MAX = 8
MS = 1e-3


def curve(fn, xs=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> Curve:
    c = Curve()
    for x in xs:
        c.observe(x, fn(x))
    return c


def costs(verify, draft, state=lambda n: 0.05 * MS) -> CostModel:
    return CostModel(verify=curve(verify), draft=curve(draft), state=curve(state))


def requests(n: int, greedy: bool = True, start: int = 0) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(start + i, str(start + i), [1] * 16, SamplingParams(max_tokens=1000, temperature=0.0 if greedy
                                                                         else 0.8))
        r.output_token_ids = [2] * 10
        r.num_cached_target = r.num_cached_draft = r.num_tokens - 1  # one in-flight token, as after a round
        out.append(r)
    return out


def policy(cost: CostModel, branching=(1,) * K_MAX, **kw) -> AdaptivePolicy:
    if not {"explore_every", "explore_min"} & kw.keys():  # the plan, not an exploration step (the curves built
        kw.update(explore_every=10**9, explore_min=10**9)  # here are all "old"); exploration tests set them
    return AdaptivePolicy(SpecPolicy(TreeShape(tuple(branching)), 100_000, 100_000), cost=cost, **kw)


def teach(p: AdaptivePolicy, req: Request, rate: float, rounds: int = 30, seed: int = 0,
          branching=(1,) * K_MAX) -> None:
    """Rounds of a draft whose every candidate is accepted with probability ``rate``."""
    rng = random.Random(seed)
    for _ in range(rounds):
        a = 0
        while a < len(branching) and rng.random() < rate:
            a += 1
        p.observe_round(req, tuple(branching), a)


MEMORY_BOUND = dict(verify=lambda n: 10 * MS, draft=lambda n: 0.2 * MS)  # flat: a batch costs one weight read
COMPUTE_BOUND = dict(verify=lambda n: 1 * MS * n, draft=lambda n: 0.1 * MS * n)  # every token costs the same


def test_memory_bound_costs_give_long_chains() -> None:
    p = policy(costs(**MEMORY_BOUND))
    reqs = requests(4)
    for r in reqs:
        teach(p, r, 0.85, seed=r.seq_id)
    assert p.plan(reqs) == [(1,) * K_MAX] * 4


def test_verify_cost_linear_in_tokens_gives_no_speculation() -> None:
    p = policy(costs(**COMPUTE_BOUND))
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.85, seed=r.seq_id)
    assert p.plan(reqs) == [()] * 32


def test_a_wide_lead_of_plain_decode_skips_the_search_for_a_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute-bound: plain decode leads every speculating plan by far. The search runs once, then the next
    ``clear_steps`` steps of that batch size decode plainly without it; a step of another batch size searches
    again at once. With a lead under ``clear_lead`` it searches every step."""
    searches = []
    search = AdaptivePolicy.best_chains
    monkeypatch.setattr(AdaptivePolicy, "best_chains", lambda self, rs: searches.append(len(rs)) or search(self, rs))
    cost = costs(**COMPUTE_BOUND)
    cost.draft_call = curve(lambda n: 10 * MS)  # every speculating plan pays it: 24 % behind plain decode
    p = policy(cost)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.85, seed=r.seq_id)
    for _ in range(6):
        assert p.plan(reqs) == [()] * 32
    assert searches == [32, 32]  # steps 1 and 6: the 4 in between skipped it
    p.plan(reqs[:8])
    assert searches[-1] == 8
    searches.clear()
    # The draft call at 5 ms: speculating is 14 % behind, but still in reach of the estimates' drift.
    cost.draft_call = curve(lambda n: 5 * MS)
    q = policy(cost, clear_lead=0.15)
    for r in reqs:
        teach(q, r, 0.85, seed=r.seq_id)
    for _ in range(3):
        assert q.plan(reqs) == [()] * 32
    assert 0 < q.spec_rate and len(searches) == 3, (q.spec_rate, searches)


def test_a_plain_lead_ends_when_plain_decode_is_measured_dearer() -> None:
    """The lead that skips the search is held on plain decode's price as measured since it was set: a plain step
    found far dearer than its curve said (the start-up profiling's short contexts) plans again at once, and
    speculates where the search now prices it ahead."""
    cost = costs(**COMPUTE_BOUND)
    cost.draft_call = curve(lambda n: 10 * MS)
    p = policy(cost)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.85, seed=r.seq_id)
    assert p.plan(reqs) == [()] * 32  # the search: plain decode leads by 24 %, held for the next steps
    assert p.plan(reqs) == [()] * 32
    cost.verify.observe(32, 300 * MS)  # the plain step took 300 ms, not 32: its point moves half way
    shapes = p.plan(reqs)
    assert any(shapes), shapes


def test_compute_bound_only_past_a_batch_size() -> None:
    """Flat up to 64 tokens, linear beyond: a small batch speculates, a large one does not."""
    p = policy(costs(verify=lambda n: 10 * MS * max(1.0, n / 64), draft=lambda n: 0.2 * MS * max(1.0, n / 64)))
    small, large = requests(2), requests(64, start=100)
    for r in small + large:
        teach(p, r, 0.8, seed=r.seq_id)
    assert all(len(s) >= 4 for s in p.plan(small))
    assert p.plan(large) == [()] * 64


def test_a_disagreeing_draft_gets_a_shorter_chain() -> None:
    p = policy(costs(verify=lambda n: 10 * MS + 0.3 * MS * n, draft=lambda n: 0.5 * MS))
    good, bad = requests(2)
    teach(p, good, 0.95, seed=1)
    teach(p, bad, 0.4, seed=2)
    g, b = p.plan([good, bad])
    assert len(b) < len(g), (g, b)
    assert len(g) >= 4


def test_chains_are_never_worse_than_every_request_at_one_depth() -> None:
    """A draft forward's fixed cost is paid once per level any request reaches: ordered by value alone, the
    confident requests' deep candidates came before the others' shallow ones, and the plan ran 8 forwards for a
    few requests' tails where every request at one depth was better (concurrency 16 in-process: predicted 4-7 %
    slower than all at 4). Priced here by hand, apart from the policy's own pricing."""
    verify, draft = (lambda n: 10 * MS + 0.2 * MS * n), (lambda n: 3 * MS + 0.05 * MS * n)
    p = policy(costs(verify=verify, draft=draft))
    reqs = requests(8)
    for r in reqs:
        teach(p, r, 0.97 if r.seq_id < 2 else 0.7, seed=r.seq_id, rounds=60)
    prior = p.acceptance.engine_rates(True, K_MAX)
    rates = [p.acceptance.rates(r.seq_id, True, K_MAX, prior=prior) for r in reqs]

    def rate(depths: list[int]) -> float:
        tokens = sum(expected_tokens(a, k) for a, k in zip(rates, depths, strict=True))
        forwards = [sum(k > f for k in depths) for f in range(max(depths))]
        seconds = verify(sum(1 + k for k in depths)) + sum(draft(n) for n in forwards) + 0.05 * MS
        return tokens / seconds

    chosen = [len(s) for s in p.plan(reqs)]
    uniform = max(range(K_MAX + 1), key=lambda k: rate([k] * len(reqs)))
    assert rate(chosen) >= rate([uniform] * len(reqs)) * 0.999, (chosen, uniform)


def test_new_requests_start_from_their_regimes_rates() -> None:
    """The engine-wide rates per regime are the prior: greedy drafts agree here, sampled ones rarely."""
    p = policy(costs(verify=lambda n: 10 * MS + 0.3 * MS * n, draft=lambda n: 0.5 * MS))
    old_greedy, old_sampled = requests(1), requests(1, greedy=False, start=1)
    for i in range(10):
        teach(p, old_greedy[0], 0.95, seed=i)
        teach(p, old_sampled[0], 0.3, seed=100 + i)
    new_greedy, new_sampled = requests(1, start=10), requests(1, greedy=False, start=11)
    g, s = p.plan(new_greedy + new_sampled)
    assert len(s) < len(g)


def test_the_configured_tree_only_where_it_measures_better() -> None:
    cost = costs(verify=lambda n: 10 * MS + 0.5 * MS * n, draft=lambda n: 0.5 * MS)
    tree = (2, 1, 1, 1)
    for tree_rate, want_tree in ((0.55, False), (0.99, True)):
        p = policy(cost, branching=tree)
        reqs = requests(4)
        for r in reqs:
            teach(p, r, 0.6, seed=r.seq_id, branching=(1, 1, 1, 1))
            teach(p, r, tree_rate, seed=50 + r.seq_id, branching=tree)
        shapes = p.plan(reqs)
        assert (shapes == [tree] * 4) == want_tree, (tree_rate, shapes)


def test_each_request_gets_the_tree_only_where_its_own_rounds_measure_it_better() -> None:
    """The menu is per request: in one batch, requests whose tree rounds accept far more than their chains take
    the tree, the others keep chains (all-or-nothing would give both groups the same shape)."""
    cost = costs(verify=lambda n: 10 * MS + 0.5 * MS * n, draft=lambda n: 0.5 * MS)
    tree = (2, 1, 1, 1)
    p = policy(cost, branching=tree)
    p.acceptance.request_prior_weight = 2.0  # the two groups differ: their own rounds decide
    reqs = requests(4)
    for r in reqs:
        teach(p, r, 0.6, seed=r.seq_id, branching=(1, 1, 1, 1))
        teach(p, r, 0.99 if r.seq_id < 2 else 0.5, seed=50 + r.seq_id, branching=tree)
    shapes = p.plan(reqs)
    assert shapes[:2] == [tree, tree], shapes
    assert all(all(w == 1 for w in s) for s in shapes[2:]), shapes


def noisy_run(hysteresis: float, steps: int = 300) -> int:
    """How often the chosen depths change over ``steps`` steps of noisy costs and acceptance, near a tie."""
    rng = random.Random(7)
    cost = costs(verify=lambda n: 10 * MS + 0.8 * MS * n, draft=lambda n: 0.5 * MS)
    p = policy(cost, hysteresis=hysteresis, explore_every=10**9, explore_min=10**9)  # no exploration
    # Noisy acceptance estimates: a request's few rounds weigh about as much as the engine's rates.
    p.acceptance.request_prior_weight = 2.0
    reqs = requests(8)
    changes, last = 0, None
    for _ in range(steps):
        shapes = p.plan(reqs)
        changes += last is not None and shapes != last
        last = shapes
        for r, s in zip(reqs, shapes, strict=True):  # the rounds: acceptance 0.75 per position
            teach(p, r, 0.75, rounds=1, seed=rng.randrange(1 << 30), branching=s or (1,))
        n = 8 + sum(len(s) for s in shapes)
        p.observe_step(StepSample(n, (10 + 0.8 * n) * MS * rng.uniform(0.7, 1.3), [8] * max(map(len, shapes)),
                                  0.5 * MS * max(map(len, shapes)) * rng.uniform(0.7, 1.3), False, 8,
                                  0.05 * MS * rng.uniform(0.7, 1.3)))
    return changes


def test_the_choice_is_stable_on_noise() -> None:
    assert noisy_run(hysteresis=0.03) <= 300 // 20  # at most one step in 20 changes anything


def test_without_hysteresis_the_same_noise_makes_it_flap() -> None:
    """The negative control of the test above: the setup is near a tie, so noise alone flips the choice."""
    assert noisy_run(hysteresis=0.0) > 300 // 10


def test_exploration_measures_the_unused_plan_again() -> None:
    """At K = 0 the full depth is run once every ``explore_every`` steps, so a changed machine is noticed."""
    p = policy(costs(**COMPUTE_BOUND), explore_every=16, min_rounds=0)  # no acceptance taught: plan anyway
    reqs = requests(4)
    plans = []
    for _ in range(40):
        shapes = p.plan(reqs)
        plans.append(shapes)
        n = 4 + sum(len(s) for s in shapes)
        p.observe_step(StepSample(n, 1 * MS * n, [4] * max(map(len, shapes)), 0.4 * MS, False, 4, 0.0))
    explored = [i for i, s in enumerate(plans) if any(s)]
    assert 1 <= len(explored) <= 3 and p.explored_steps == len(explored), explored


def explorations(draft_ms: float, steps: int = 200, backoff: int = 0, plain_noise: float = 0.0) -> int:
    """Plain-decode steps (explorations) while a chain of 4 runs: verify flat at 10 ms (memory-bound), each draft
    forward ``draft_ms``, the chain's candidates accepted at 0.8 per position (3.36 tokens a round). A plain
    step measures 10 ms x (1 +- ``plain_noise``), alternately."""
    k = 4
    p = policy(costs(verify=lambda n: 10 * MS, draft=lambda n: draft_ms * MS), branching=(1,) * k,
               explore_every=64, explore_backoff=backoff)
    req = requests(1)
    teach(p, req[0], 0.8, rounds=200, branching=(1,) * k)
    n = 0
    for _ in range(steps):
        shapes = p.plan(req)
        n += shapes == [()]
        depth = max(map(len, shapes))
        verify = 10 * MS * (1 + (plain_noise if n % 2 else -plain_noise) if depth == 0 else 1)
        p.observe_step(StepSample(1 + depth, verify, [1] * depth, draft_ms * MS * depth, False, 1, 0.05 * MS))
    return n


def test_an_unused_plan_predicted_close_is_explored_more_often() -> None:
    """Exploration spends ~explore_budget of the time: plain decode predicted 1.3x slower per token than the
    chain (slow draft) is re-measured every ``explore_min`` steps, so a wrong estimate is corrected quickly;
    predicted 3x slower (fast draft), about every 20 steps (a plain step is cheap: it loses 2/3 of its 10 ms)."""
    close, far = explorations(3.9), explorations(0.3)
    assert close >= 2 * far >= 12, (close, far)


def test_explorations_that_find_nothing_new_are_spaced_further_apart() -> None:
    """Each exploration that measures plain decode where the curve had it doubles its interval (up to 8x): 25
    explorations in 200 steps become a handful. One that finds it 30 % off (a changed machine) resets the
    interval: measured alternately 30 % above and below, plain decode is explored as often as without backoff."""
    plain = explorations(3.9)
    assert explorations(3.9, backoff=3) <= plain // 3, plain
    assert explorations(3.9, backoff=3, plain_noise=0.3) >= plain - 2


def exploring_share(n: int = 64, steps: int = 250, behind: int = 0, **kw) -> tuple[int, float]:
    """Saturation, compute-bound (verify 4.5 ms a token, draft 1 ms a token, batch 64): plain decode runs (0.29 s
    a step). Explorations, and the share of the run's time they lost against plain steps. ``behind``: tokens each
    request's draft has to catch up before its first candidate (it decoded plainly that long)."""
    p = policy(costs(verify=lambda t: 4.5 * MS * t, draft=lambda t: 1 * MS * t), **{"explore_every": 256, **kw})
    reqs = requests(n)
    for r in reqs:
        teach(p, r, 0.7, seed=r.seq_id)
        r.output_token_ids = [2] * (10 + behind)
        r.num_cached_target = r.num_tokens - 1
        r.num_cached_draft = r.num_cached_target - behind
    explored, lost, total = 0, 0.0, 0.0
    for _ in range(steps):
        shapes = p.plan(reqs)
        fwd = [sum(len(s) > f for s in shapes) for f in range(max(map(len, shapes)))]
        if fwd:
            fwd[0] += behind * fwd[0]
        t = n + sum(len(s) for s in shapes)
        secs = 4.5 * MS * t + 1 * MS * sum(fwd)
        explored += any(shapes)
        lost += secs - 4.5 * MS * n
        total += secs
        p.observe_step(StepSample(t, 4.5 * MS * t, fwd, 1 * MS * sum(fwd), False, n, 0.05 * MS))
    return explored, lost / total


def test_an_exploration_step_many_times_longer_than_a_plain_one_is_rare() -> None:
    """Exploring spends ~explore_budget (3 %) of the time: its interval is priced by what its step loses against
    the plain one."""
    explored, share = exploring_share()
    assert explored >= 1 and share <= 0.05, (explored, share)


@pytest.mark.parametrize("stall", [3.0, 1e9])
def test_an_exploration_many_steps_long_spends_less_than_the_budget(stall: float) -> None:
    """The drafts are 200 tokens behind: an exploration step (a few requests feed their drafts 201 tokens each)
    is ~8 plain steps long, a stall every stream of the batch feels. It gets the budget scaled by 3 / its length
    in steps: one exploration in 600 steps, 1.1 % of the time; the control (no scaling) explores twice, 2.2 %."""
    explored, share = exploring_share(steps=600, behind=200, explore_stall=stall, explore_every=10**6,
                                      explore_floor=0.0,  # (the floor alone would skip it: test_a_dear_plan_...)
                                      explore_odds=0.0)  # (and so would the odds: the test below)
    assert explored >= 1, explored
    assert (share < 0.015) == (stall == 3.0), share


@pytest.mark.parametrize("odds", [2.0, 0.0])
def test_from_plain_decode_a_plan_predicted_far_slower_is_explored_less_often(odds: float) -> None:
    """Saturation (the setup above, drafts caught up, no backoff): the few requests an exploration speculates on
    are predicted at ~0.6x plain decode's rate, so it gets ~0.35 of the budget: 11 explorations in 1000 steps,
    1.3 % of the time. The control (every plan the whole budget) explores 31 times, 3.7 %."""
    explored, share = exploring_share(steps=1000, explore_every=10**6, explore_odds=odds, explore_backoff=0)
    assert explored >= 1, explored
    assert (share < 0.02) == (odds == 2.0), (explored, share)


def test_while_plain_decode_runs_a_few_requests_explore() -> None:
    """At K = 0 the exploration step speculates on a few requests (those whose draft has least to catch up), with
    as many candidates as chains of 1 for everyone, not on every request: each request that speculates first
    feeds its draft its whole prefix."""
    p = policy(costs(verify=lambda t: 4.5 * MS * t, draft=lambda t: 1 * MS * t), explore_every=1, explore_min=1)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.7, seed=r.seq_id)
    for r in reqs[8:]:
        r.num_cached_draft = 0  # never speculated: their drafts have the whole prefix to catch up
    shapes = p.plan(reqs)
    assert sum(map(len, shapes)) == 32 and all(not s for s in shapes[8:]), shapes


@pytest.mark.parametrize("prefill", [False, True])
def test_no_exploration_in_a_step_that_prompt_chunks_share(prefill: bool) -> None:
    """An exploration is due (every step here); with prompt chunks in the step it waits: their time would be
    most of the step, which then measures a prefill-sized call and not the decode size explored. The control
    (no prefill) explores."""
    p = policy(costs(verify=lambda t: 4.5 * MS * t, draft=lambda t: 1 * MS * t), explore_every=1, explore_min=1)
    reqs = requests(8)
    for r in reqs:
        teach(p, r, 0.7, seed=r.seq_id)
    shapes = p.plan(reqs, prefill=prefill)
    assert (shapes == [()] * 8) == prefill and p.explored_steps == (not prefill), shapes


@pytest.mark.parametrize("margin,want", [(0.05, [()]), (0.0, [(1,)])])
def test_speculation_predicted_barely_better_than_plain_decode_is_not_run(margin: float, want) -> None:
    """Verify 10 ms + 9 ms a token more, a draft forward 0.3 ms, acceptance 0.95: a chain of 1 is predicted 1 %
    faster per token than plain decode. Within ``spec_margin`` plain decode runs; with no margin (the control)
    the chain does."""
    p = policy(costs(verify=lambda n: 10 * MS + 9 * MS * max(0, n - 1), draft=lambda n: 0.3 * MS,
                     state=lambda n: 0.0), spec_margin=margin, min_rounds=0)
    req = requests(1)
    teach(p, req[0], 0.95, rounds=200)
    assert p.plan(req) == want


def test_unmeasured_costs_run_the_configured_depth_only_where_it_measures_them() -> None:
    """With nothing measured, a regime's first rounds (pinned: ``min_rounds``) run the configured depth, cut to
    their caps, and the rest of the batch decodes plainly; once the regime is seen, plain decode and a few
    requests at the configured depth take turns until the curves can price a plan. The configured depth for
    everyone (the control, as this was) stalled 32 requests for 3-4 s a step at batch 32 on the larger random
    pair, against 0.6 s for plain decode."""
    p = policy(CostModel())
    reqs = requests(32)
    reqs[0].params = SamplingParams(max_tokens=13, temperature=0.0)  # 3 tokens left: at most a chain of 2
    assert p.plan(reqs) == [(1, 1)] + [(1,) * K_MAX] * 7 + [()] * 24
    p.min_rounds = 0  # the regime's rounds seen
    assert p.plan(reqs) == [()] * 32
    turn = p.plan(reqs)
    assert sum(map(len, turn)) == 32 * K_MAX // 2 and sum(1 for s in turn if s) == 17, turn
    assert p.plan(reqs) == [()] * 32
    assert p.plan(reqs) == turn


def test_unmeasured_costs_with_no_room_to_speculate_decode_plainly() -> None:
    """The cold turn of a few requests speculating, where every request has one token left (caps 0): nothing can
    speculate, so the turn is plain decode (it indexed an empty list of turns and failed the engine's step)."""
    p = policy(CostModel(), min_rounds=0)
    reqs = requests(4)
    for r in reqs:
        r.params = SamplingParams(max_tokens=11, temperature=0.0)  # 1 token left: cap 0
    assert [p.plan(reqs) for _ in range(2)] == [[()] * 4] * 2


def test_the_control_of_unmeasured_costs_runs_the_configured_depth_for_everyone(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """The property above, broken: ``_cold`` giving the configured depth (what the fixed policy runs)."""
    p = policy(CostModel(), min_rounds=0)
    monkeypatch.setattr(p, "_cold", lambda rs, fixed: fixed)
    assert sum(map(len, p.plan(requests(32)))) == 32 * K_MAX


def test_curve_interpolates_and_never_gets_cheaper_past_its_last_point() -> None:
    c = curve(lambda n: 1.0 + n, xs=(1, 16))
    assert c(8) == pytest.approx(9.0) and c(32) == pytest.approx(33.0) and c(0) == 0.0
    flat = curve(lambda n: 5.0 - n * 0.01, xs=(1, 64))
    assert flat(1000) >= flat(64)


def test_acceptance_counts_per_position() -> None:
    t = AcceptanceTracker(request_decay=1.0, engine_decay=1.0, prior_weight=1e-9)
    for a in (0, 1, 2, 2):  # depth 2: accepted 0, 1, 2, 2 candidates
        t.observe(0, True, False, 2, a)
    rates = t.rates(0, True, 2)
    assert rates[0] == pytest.approx(0.75, abs=0.05) and rates[1] == pytest.approx(2 / 3, abs=0.05)
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_a_regime_whose_only_rounds_ran_the_tree_prices_chains_from_them() -> None:
    """The sampled regime's first rounds ran the configured tree ([2, 1, 1, 1], pinned), accepting ~0.9 a level;
    no chain round yet. The chains are priced from those rounds, not DEFAULT_RATE (0.7): a policy whose chains
    looked 0.7 a position decoded plainly and never ran the chain rounds that would have measured them (at batch
    1, T = 0.8, built-in pair, half the fresh engines, ~95 % of their rounds). The tree keeps its own rates."""
    t = AcceptanceTracker()
    rng = random.Random(0)
    for _ in range(20):
        a = 0
        while a < 4 and rng.random() < 0.9:
            a += 1
        t.observe(0, False, True, 4, a)
    chain = t.engine_rates(False, 4)
    assert min(chain) > 0.8, chain
    assert t.rates(1, False, 4) == chain  # a new request's chain prior
    assert t.engine_rates(False, 4, (2, 1, 1, 1)) == pytest.approx(chain, abs=0.05)


def test_batch_size_schedule() -> None:
    p = BatchSizeSchedule(TreeShape.chain(4), 100_000, 100_000, ((1, 4), (4, 2), (16, 0)))
    assert [p.depth_for_batch(b) for b in (1, 3, 4, 15, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert p.plan(requests(5)) == [(1, 1)] * 5


def test_a_noisy_dip_does_not_make_more_tokens_cheaper() -> None:
    c = Curve(decay=1.0)
    for x, y in ((1, 46.0), (2, 84.0), (4, 33.0), (8, 53.0), (32, 41.0)):  # measured on a loaded CPU
        c.observe(x, y)
    ys = [c(x) for x in (1, 2, 3, 4, 8, 16, 32, 64)]
    assert ys == sorted(ys)
    assert monotone([3.0, 1.0, 2.0, 5.0]) == [2.0, 2.0, 2.0, 5.0]


def test_sampled_steps_are_priced_with_their_own_curves() -> None:
    """Greedy steps measured memory-bound, sampled steps (laws travel, residuals sampled) compute-bound."""
    p = policy(costs(**MEMORY_BOUND))
    p.sampled_cost = costs(**COMPUTE_BOUND)
    greedy, sampled = requests(4), requests(4, greedy=False, start=10)
    for r in greedy + sampled:
        teach(p, r, 0.85, seed=r.seq_id)
    assert p.plan(greedy) == [(1,) * K_MAX] * 4
    assert p.plan(sampled) == [()] * 4


# --------------------------------------------------------------------------- depths the policy has not tried yet
def test_an_untried_depth_looks_like_the_deepest_measured_one() -> None:
    """A policy that ran depth 4 with every candidate accepted must not see depth 5 at a fixed 0.7 prior (it would
    stop at 4 for good: its rounds never reach depth 5 to measure it)."""
    t = AcceptanceTracker()
    for _ in range(50):
        t.observe(0, True, False, 4, 4)
    rates = t.engine_rates(True, K_MAX)
    assert min(rates[4:]) > 0.95, rates
    # Draft forwards cost a fifth of a verify: worth going past 4 at 0.98, not at 0.7 (0.7 ** 5 * 10 < 2.5).
    p = policy(costs(verify=lambda n: 10 * MS, draft=lambda n: 2.5 * MS))
    p.acceptance = t
    reqs = requests(1)
    for _ in range(30):
        p.observe_round(reqs[0], (1,) * 4, 4)
    assert len(p.plan(reqs)[0]) > 4


# ------------------------------------------------------------------------- the draft call's fixed part, apart
def test_the_draft_calls_fixed_part_is_not_charged_per_forward() -> None:
    """Calls of 2 and 8 forwards, each forward 1 ms and the call 10 ms on top: a 2-deep round's draft must cost
    12 ms and an 8-deep one 18 ms (charging call / forwards per forward would price 8 forwards from the 2-deep
    calls at 6 ms each)."""
    c = CostModel()
    for depth in (2, 8) * 20:
        c.observe(StepSample(1 + depth, 10 * MS, [1] * depth, (10 + depth) * MS, False, 1, 0.0,
                             draft_worker_s=depth * MS))
    assert c.draft_seconds([1] * 2) == pytest.approx(12 * MS, rel=0.05)
    assert c.draft_seconds([1] * 8) == pytest.approx(18 * MS, rel=0.05)
    assert c.draft_seconds([]) == 0.0


def test_each_draft_forward_is_priced_at_its_own_size() -> None:
    """The worker times every forward: the first (the in-flight tokens, 4 here) 3 ms, the one-token levels 1 ms
    each, the call 1 ms on top. A chain of 2 must cost 1 + 3 + 1 ms and one of 8 1 + 3 + 7 ms; charged the call's
    mean per forward at the mean size (2.5 and 1.375 tokens, one bucket) both sit between, and the short chain
    looks cheaper than it is."""
    c = CostModel()
    for depth in (2, 8) * 20:
        fwd = [4] + [1] * (depth - 1)
        secs = [3 * MS] + [1 * MS] * (depth - 1)
        c.observe(StepSample(4 + depth, 10 * MS, fwd, sum(secs) + 1 * MS, False, 1, 0.0,
                             draft_worker_s=sum(secs), draft_forward_s=secs))
    assert c.draft_seconds([4, 1]) == pytest.approx(5 * MS, rel=0.05)
    assert c.draft_seconds([4] + [1] * 7) == pytest.approx(11 * MS, rel=0.05)


def _draft_ms(tokens: float, seqs: int) -> float:
    """A draft forward whose cost is mostly its sequences' (each reads its own context)."""
    return 0.5 + 0.05 * tokens + 1.0 * seqs


def _chain_step(seqs: int, depth: int, first: int, seqs_known: bool) -> StepSample:
    """``seqs`` chains of ``depth`` whose first forward carries ``first`` tokens each (verify flat, ~40 ms)."""
    fwd = [seqs * first] + [seqs] * (depth - 1)
    secs = [_draft_ms(n, seqs) * MS for n in fwd]
    tokens = seqs * (depth + 1)
    return StepSample(tokens, (40 + 0.02 * tokens) * MS, fwd, sum(secs), False, seqs, 0.0, draft_worker_s=sum(secs),
                      draft_forward_s=secs, draft_forward_seqs=[seqs] * depth if seqs_known else None)


@pytest.mark.parametrize("seqs_known", [True, False])
def test_a_draft_forward_is_priced_at_its_sequence_count(seqs_known: bool) -> None:
    """At concurrency 64 (larger random pair) a first forward of 107 tokens over 64 sequences took 0.14-0.21 s,
    priced 0.07 s from the start-up's forwards over 8 sequences x 13 tokens: the first bet of each wave ran on.
    Here 64 sequences cost 64 ms more than 8 at the same tokens; plain steps of 64 and one bet (64 chains of 1)
    measured, then the 8-sequence forwards: a chain for 64 requests must be priced at 64 sequences, and plain
    decode chosen. The control (the sequences not reported: one curve over tokens) prices them at 8 and runs
    chains for everyone."""
    cost = CostModel()
    for _ in range(3):
        cost.observe(StepSample(64, (40 + 0.02 * 64) * MS, [], 0.0, False, 64, 0.0))
        cost.observe(_chain_step(64, 1, 2, seqs_known))
    for _ in range(6):
        cost.observe(_chain_step(8, 4, 13, seqs_known))
    priced = cost.draft_forward(115, 64)
    assert (priced > 0.8 * _draft_ms(115, 64) * MS) == seqs_known, priced
    assert cost.draft_forward(104, 8) == pytest.approx(_draft_ms(104, 8) * MS, rel=0.05 if seqs_known else 0.5)
    p = policy(cost)
    reqs = requests(64)
    for r in reqs:
        teach(p, r, 0.9, seed=r.seq_id)
    speculating = sum(len(s) > 0 for s in p.plan(reqs))
    assert (speculating == 0) == seqs_known, speculating


def test_a_draft_forward_over_an_unmeasured_sequence_count_is_priced_between_the_measured_ones() -> None:
    """Measured over 8 and 64 sequences: 40 sequences (bucket 32, never measured) must cost between the two,
    linear in the sequences; 128 on the line of 8 and 64; 2 no more than 8 (fewer never cost more)."""
    cost = CostModel()
    for seqs in (8, 64) * 3:
        for tokens in (seqs, 2 * seqs):
            cost.observe(StepSample(tokens, 0.0, [tokens], _draft_ms(tokens, seqs) * MS, False, seqs, 0.0,
                                    draft_worker_s=_draft_ms(tokens, seqs) * MS,
                                    draft_forward_s=[_draft_ms(tokens, seqs) * MS], draft_forward_seqs=[seqs]))
    at8, at64 = cost.draft_forward(80, 8), cost.draft_forward(80, 64)
    assert at8 < cost.draft_forward(80, 40) < at64
    assert cost.draft_forward(80, 40) == pytest.approx(at8 + (at64 - at8) * 32 / 56, rel=1e-6)
    assert cost.draft_forward(80, 128) == pytest.approx(at64 + (at64 - at8) * 64 / 56, rel=1e-6)
    assert cost.draft_forward(80, 2) == pytest.approx(at8, rel=1e-6)


def test_a_catch_up_past_a_sequence_counts_sizes_is_not_priced_on_its_steep_line() -> None:
    """Batch 1's forwards measured at 1 and 2 tokens (4.9 and 6.1 ms: a steep line) and the all-forwards curve
    at 3.6 and 189 tokens (7.3, 23.5 ms): a first forward feeding 40 tokens of catch-up over one sequence must
    be priced near the all-forwards shape (~10 ms), not on the line (51 ms), which kept a lone request on plain
    decode for its whole life in the served test (its catch-up grows while it does)."""
    cost = CostModel()
    for n, ms in ((1, 4.9), (2, 6.1)) * 3:
        cost.observe(StepSample(n + 1, 0.0, [n], ms * MS, False, 1, 0.0, draft_worker_s=ms * MS,
                                draft_forward_s=[ms * MS], draft_forward_seqs=[1]))
    for n, ms in ((3.6, 7.3), (189, 23.5)):
        cost.draft.observe(n, ms * MS)
    assert 8 * MS < cost.draft_forward(40, 1) < 12 * MS, cost.draft_forward(40, 1)
    assert cost.draft_forward(1.5, 1) == pytest.approx(5.5 * MS, rel=0.02)  # within its sizes: its own line


def test_a_depth_a_request_stopped_reaching_drifts_back_to_the_prior() -> None:
    """One miss at depth 3 early on, then rounds of depth 2 that accept both: the request's rate at depth 3 must
    return towards the engine's (0.9 here) as its evidence ages, not keep the miss until the request ends (its
    shallow rounds never try depth 3 again)."""
    t = AcceptanceTracker(request_prior_weight=2.0)  # one miss weighs enough to move the request's estimate
    for _ in range(200):
        t.observe(99, True, False, 4, 4 if random.Random(_).random() < 0.9 else 2)  # the engine: ~0.9 at depth 3
    t.observe(0, True, False, 4, 2)  # the request's one round at depth 4: depth 3 missed
    prior = t.engine_rates(True, 4)
    assert t.rates(0, True, 4, prior=prior)[2] < prior[2] - 0.2
    for _ in range(30):
        t.observe(0, True, False, 2, 2)
    assert t.rates(0, True, 4, prior=prior)[2] > prior[2] - 0.1


@pytest.mark.parametrize("idle_decay, drifts", [(0.99, True), (1.0, False)])
def test_an_engine_wide_depth_the_rounds_stopped_reaching_drifts_back_to_the_one_above(idle_decay: float,
                                                                                       drifts: bool) -> None:
    """The first rounds of a regime (depth 8) miss at positions 7 and 8, then 300 rounds of depth 5 accept ~0.9:
    the engine's rates at 7 and 8 must return towards the one above them, or the policy, which priced them at
    the early misses, never runs deep enough to measure them again (at batch 1, T = 0.8, built-in pair: 0.42 and
    0.28 against ~0.88 above, depth 5 for the rest of the run). The control (no idle ageing) keeps the misses."""
    t = AcceptanceTracker(engine_idle_decay=idle_decay)
    for s in range(8):
        t.observe(s, False, False, 8, 6)
    assert t.engine_rates(False, 8)[6] < 0.5
    rng = random.Random(0)
    for s in range(300):
        a = 0
        while a < 5 and rng.random() < 0.9:
            a += 1
        t.observe(100 + s // 30, False, False, 5, a)
    rates = t.engine_rates(False, 8)
    assert (min(rates[5:]) > 0.7) == drifts  # from 0.2
    assert rates[0] == pytest.approx(0.9, abs=0.05)  # what the rounds reach keeps its measured rate


def _rounds(t: AcceptanceTracker, seq_id: int, rate: float, rounds: int, rng: random.Random) -> None:
    for _ in range(rounds):  # chains of 4, each candidate accepted with probability ``rate``
        a = 0
        while a < 4 and rng.random() < rate:
            a += 1
        t.observe(seq_id, True, False, 4, a)


def _finish(t: AcceptanceTracker, seq_ids: range, rate: float, rounds: int = 30) -> None:
    rng = random.Random(seq_ids.start)
    for s in seq_ids:
        _rounds(t, s, rate, rounds, rng)
        t.forget(s)


def test_alike_requests_make_one_miss_weigh_little() -> None:
    """Requests that all accept ~0.9 (their rates scatter by no more than their noise): the engine's rates are
    worth many rounds, and a new request's one miss leaves it near them. With a request's own rounds weighing
    about as much as the prior (the old fixed weight of 2) one miss put a greedy request that accepts ~90 % at a
    0.6 draft and on chains of 1-2."""
    t = AcceptanceTracker()
    _finish(t, range(0, 16), 0.9)
    assert t.request_weight(True) >= 16
    t.observe(100, True, False, 4, 0)
    prior = t.engine_rates(True, 4)
    assert t.rates(100, True, 4, prior=prior)[0] > prior[0] - 0.06
    fixed = AcceptanceTracker(request_prior_weight=2.0)
    _finish(fixed, range(0, 16), 0.9)
    fixed.observe(100, True, False, 4, 0)
    assert fixed.rates(100, True, 4, prior=fixed.engine_rates(True, 4))[0] < prior[0] - 0.25  # the control


def test_requests_too_alike_to_tell_apart_are_planned_from_the_engines_rates() -> None:
    """Requests that all accept 0.9 at every position: no spread to measure, so a request's own misses (at the
    first position, and a run of them deeper) leave its plan on the engine's rates: the depth-4 chains of a batch
    are all alike. Weighing its ~5 remembered rounds against 32 of the engine's (as before) moved its estimates by
    their noise: on the built-in pair at batch 32 that cost 2-3 % against planning from the engine's rates."""
    t = AcceptanceTracker()
    _finish(t, range(0, 16), 0.9)
    assert t.request_weight(True) == math.inf
    t.observe(100, True, False, 4, 0)
    for _ in range(3):
        t.observe(101, True, False, 4, 2)
    prior = t.engine_rates(True, 4)
    assert t.rates(100, True, 4, prior=prior) == prior == t.rates(101, True, 4, prior=prior)
    capped = AcceptanceTracker(request_prior_weight=32.0)  # the control: the old most weight
    _finish(capped, range(0, 16), 0.9)
    capped.observe(100, True, False, 4, 0)
    assert capped.rates(100, True, 4, prior=capped.engine_rates(True, 4))[0] < prior[0] - 0.01


def test_requests_that_differ_keep_their_own_rates() -> None:
    """Half the requests accept 0.95, half 0.4: the spread is real, the prior is worth few rounds, and each
    request's own rounds decide (finished or still running)."""
    t = AcceptanceTracker()
    _finish(t, range(0, 8), 0.95)
    _finish(t, range(8, 16), 0.4)
    assert t.request_weight(True) <= 3.0
    running = AcceptanceTracker()
    _finish(running, range(0, 1), 0.95)  # too few finished: the running requests measure the spread
    rng = random.Random(3)
    for s, rate in ((20, 0.95), (21, 0.4), (22, 0.95), (23, 0.4)):
        _rounds(running, s, rate, 20, rng)
    assert running.request_weight(True) <= 4.0


def test_a_request_put_on_plain_decode_by_its_misses_speculates_again() -> None:
    """Memory-bound costs, a draft the engine has measured at 0.9: two rounds that each missed the first candidate
    put the request on plain decode. Its plain rounds age that evidence, and within tens of rounds it speculates
    again; without them (the policy told nothing of plain rounds) it stays plain (its estimates only moved when it
    speculated)."""
    def run(tell_plain: bool) -> list[int]:
        p = policy(costs(verify=lambda n: 10 * MS + 1.5 * MS * n, draft=lambda n: 5 * MS), min_rounds=0)
        p.acceptance.request_prior_weight = 2.0  # two misses weigh enough to put the request on plain decode
        others = requests(4, start=100)
        for r in others:
            teach(p, r, 0.9, rounds=50, seed=r.seq_id)
        req = requests(1)[0]
        p.observe_round(req, (1,) * K_MAX, 0)
        p.observe_round(req, (1,) * K_MAX, 0)
        depths = []
        for _ in range(40):
            d = len(p.plan([req])[0])
            depths.append(d)
            if d:
                break
            if tell_plain:
                p.observe_round(req, (), 0)
        return depths

    told, untold = run(True), run(False)
    assert told[0] == 0 and told[-1] > 0 and len(told) <= 30, told
    assert untold == [0] * 40, untold


# ---------------------------------------------------------------------------- seeded sampled requests: pinned
def test_seeded_sampled_requests_run_the_configured_shape_whatever_the_costs() -> None:
    """A seeded T > 0 request's tokens depend on its depths: it runs the configured shape, the others are planned
    (K = 0 when verify cost is linear; the configured depth when memory-bound), greedy seeded ones included."""
    for cost, deepest in ((COMPUTE_BOUND, 0), (MEMORY_BOUND, K_MAX)):
        p = policy(costs(**cost))
        reqs = requests(8, greedy=False) + requests(8, greedy=True, start=8)
        reqs[0].params.seed = 7  # sampled, seeded: pinned
        reqs[8].params.seed = 7  # greedy, seeded: its output does not depend on depth, so it is planned
        for r in reqs:
            teach(p, r, 0.85, seed=r.seq_id)
        shapes = p.plan(reqs)
        assert shapes[0] == (1,) * K_MAX
        # (compute-bound: the pinned round lowers the step's rate, so a few short chains gain a little, less than
        # ``spec_margin``: plain decode)
        assert max(len(s) for s in shapes[1:]) == deepest, shapes
        if deepest == K_MAX:
            assert shapes[1:] == [(1,) * K_MAX] * 15


# ------------------------------------------------------------------------ a prefill chunk in the same step
def test_a_prefill_in_the_same_step_does_not_make_deep_chains_look_free() -> None:
    """Beside a 2048-token prefill chunk the plan is the decode-only step's. Priced with the prefill, whose 2 s
    emit nothing, every candidate with a positive rate raised the step's tokens per second, and a batch of 32
    ran K = 8 (measured at batch 64, T=0.8: prefill steps of 3.3-6.2 s instead of 2.1 s). CPU-like costs:
    verify 30 ms to 32 tokens, then 1 ms per token; a draft forward 1 ms + 0.3 ms per token."""
    sizes = tuple(2 ** i for i in range(13))  # to 4096: every size of both plans measured (no exploration step)
    p = policy(CostModel(verify=curve(lambda n: 30 * MS + max(0, n - 32) * MS, sizes),
                         draft=curve(lambda n: 1 * MS + 0.3 * MS * n, sizes), state=curve(lambda n: 0.05 * MS)))
    reqs = requests(32, greedy=False)
    for r in reqs:
        teach(p, r, 0.8, seed=r.seq_id)
    alone = p.plan(reqs)  # the policy is not told of the prefill (Scheduler.schedule plans the decoding rounds)
    assert max(len(s) for s in alone) <= 2, alone


def test_one_slow_step_after_a_gap_does_not_become_the_curve() -> None:
    """A size re-measured after a long gap moves towards the new value, but a single 10x outlier (another
    process took the cores) must not replace a steady history."""
    c = Curve()
    for _ in range(30):
        c.observe(4, 10 * MS)
    for _ in range(200):
        c.observe(64, 200 * MS)  # the other bucket runs meanwhile: bucket 4 goes stale
    c.observe(4, 100 * MS)
    assert c(4) <= 56 * MS  # halfway: 55 ms
    for _ in range(15):  # a real change takes over at the curve's usual pace
        c.observe(4, 100 * MS)
    assert c(4) > 80 * MS


def test_an_unmeasured_tree_is_not_chosen_on_its_prior() -> None:
    """Before any tree round is measured the tree is priced at the chain's rates (its sibling gain unproven), so
    the policy keeps chains; the exploration steps (the configured shape) measure it, and then it may win."""
    cost = costs(verify=lambda n: 10 * MS + 0.05 * MS * n, draft=lambda n: 0.5 * MS)  # nodes nearly free
    tree = (3, 1, 1, 1)  # at chain rate 0.6 its independent-siblings prior (1 - 0.4^3 = 0.94) would win
    p = policy(cost, branching=tree)
    reqs = requests(4)
    for r in reqs:
        teach(p, r, 0.6, seed=r.seq_id, branching=(1, 1, 1, 1))
    assert all(all(w == 1 for w in s) for s in p.plan(reqs))
    for r in reqs:
        teach(p, r, 0.99, seed=50 + r.seq_id, branching=tree)
    assert p.plan(reqs) == [tree] * 4


def test_a_regime_without_measured_rounds_runs_the_configured_depth() -> None:
    """With no rounds measured the default prior (0.7) makes plain decode look best here; planning from it, the
    policy would never run a round and never learn that this draft accepts 0.95 (the batch-1 trap measured on
    the built-in pair). Until ``min_rounds`` rounds of the regime are seen, its requests run the configured depth."""
    p = policy(costs(verify=lambda n: 10 * MS + 0.6 * MS * n, draft=lambda n: 3.0 * MS),
               explore_every=10**9, explore_min=10**9)  # the plans, not an exploration step in between
    p.cost.draft_call = curve(lambda n: 6 * MS)
    reqs = requests(1)
    assert p.plan(reqs) == [(1,) * K_MAX]
    p.min_rounds = 0
    assert p.plan(reqs) == [()]  # what the prior alone would choose
    p.min_rounds = 8
    p._last.clear()
    teach(p, reqs[0], 0.97, rounds=10)
    assert len(p.plan(reqs)[0]) >= 6


def test_a_new_regime_pins_only_the_rounds_it_needs_to_learn() -> None:
    """At batch 32 in a regime not seen yet, ``min_rounds`` requests run the configured depth (its rates are
    measured from them); the others are planned (here: K = 0, the costs being compute-bound). Pinning all 32
    made that step cost 32 x K_max candidates. (With those pinned rounds' cost in the step, one more candidate
    of the prior's rate can pay for itself; nothing deeper does.)"""
    p = policy(costs(**COMPUTE_BOUND))
    reqs = requests(32)
    shapes = p.plan(reqs)
    assert shapes[: p.min_rounds] == [(1,) * K_MAX] * p.min_rounds
    assert all(len(s) <= 1 for s in shapes[p.min_rounds:]), shapes


def test_a_regime_is_known_after_exactly_min_rounds_rounds_even_of_the_configured_tree() -> None:
    """``min_rounds`` rounds of the configured shape make the regime known: counted undecayed (the decayed
    count of 8 rounds is 7.86, which cost a second step at K_max), and a configured tree's rounds count too
    (counting chain rounds only kept a tree configuration pinned forever)."""
    for branching in ((1,) * K_MAX, (2, 1, 1)):
        p = policy(costs(**COMPUTE_BOUND), branching=branching)
        reqs = requests(8)
        assert p.plan(reqs) == [branching] * 8
        for r in reqs:
            teach(p, r, 0.6, rounds=1, seed=r.seq_id, branching=branching)
        assert p.plan(reqs) == [()] * 8, branching


def _step(seqs: int, depth: int, verify_ms, draft_ms) -> StepSample:
    """A measured chain step: ``seqs`` rounds of ``depth`` under these costs (state free)."""
    tokens = seqs * (depth + 1)
    fwd = [seqs] * depth
    d = sum(draft_ms(n) for n in fwd) * MS
    return StepSample(tokens, verify_ms(tokens, seqs) * MS, fwd, d, False, seqs, 0.0, draft_worker_s=d)


@pytest.mark.parametrize("marked", [True, False])
def test_a_step_that_also_prefilled_does_not_make_large_decode_sizes_look_cheap(marked: bool) -> None:
    """Batch 64's decode steps cost 4 ms a token (64, 128, 192 tokens); a step that also prefilled 56 prompts
    forwarded 1800 tokens in 1.5 s (a prompt's tokens are cheap per token). 576 decode tokens must be priced
    near the decode steps' line (~2.3 s), not between 192 and the prefill step's point (~0.9 s). The control
    (the step's prompt tokens not reported) makes them look cheap."""
    cost = CostModel()
    for _ in range(3):
        for tokens in (64, 128, 192):
            cost.observe(StepSample(tokens, 4 * MS * tokens, [], 0.0, False, 64, 0.0))
        cost.observe(StepSample(1800, 1.5, [], 0.0, True, 64, 0.0, prefill_tokens=1736 if marked else 0))
    assert (cost.verify_seconds(576, 64) > 2.0) == marked, cost.verify_seconds(576, 64)


def test_the_verify_is_priced_at_the_batchs_sequence_count() -> None:
    """32 tokens cost more as 32 sequences x 1 than as 8 x 4 (measured: 33.4 vs 23.8 ms CPU, greedy; the costs
    here exaggerate it). With one curve over
    tokens, steps of a batch of 8 (8 x 4 = 32 tokens) put a false bend in the curve of a batch of 32 (its
    32-token point 40 ms instead of 112): planned on it, every request ran K = 8, where K = 1-2 is best."""
    def verify_ms(tokens, seqs):
        return 3.0 * seqs + 0.5 * tokens

    def draft_ms(n):
        return 0.5 + 0.4 * n

    cost = CostModel()
    for _ in range(3):
        for depth in range(4):
            cost.observe(_step(32, depth, verify_ms, draft_ms))
    for _ in range(6):  # a batch of 8 running K = 3 since: 32 tokens each step
        cost.observe(_step(8, 3, verify_ms, draft_ms))
    assert cost.verify_seconds(32, 32) == pytest.approx(112 * MS, rel=0.05)
    assert cost.verify_seconds(32, 8) == pytest.approx(40 * MS, rel=0.05)
    p = policy(cost)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.6, seed=r.seq_id)
    shapes = p.plan(reqs)
    depths = sorted(len(s) for s in shapes)
    assert sum(d > 0 for d in depths) >= 28 and depths[-1] <= 3, depths  # the request-own rates vary a little


def test_past_its_sizes_a_batch_sizes_curve_rises_at_least_as_its_own_last_two() -> None:
    """Batch 64 measured at 64 and 128 tokens, rising linearly (4 ms a token: compute-bound); the all-steps curve
    is flat past 128 tokens (prompt chunks: one sequence's tokens are cheap). 576 tokens at batch 64 are priced on
    the batch's own slope (~2.3 s), not the flat shape's 0.5 s; a batch size whose own curve is flat keeps the
    shape's price."""
    cost = CostModel()
    for x, y in [(8, 0.1), (64, 0.2), (128, 0.5), (512, 0.6), (2048, 0.8)]:  # other batch sizes and prefill
        cost.verify.observe(x, y)
    for x, y in [(64, 0.256), (128, 0.512)]:
        cost.verify_by_seqs.setdefault(Curve.bucket(64), Curve()).observe(x, y)
        cost.verify_by_seqs.setdefault(Curve.bucket(4), Curve()).observe(x / 16, 0.02)
    assert cost.verify_seconds(576, 64) == pytest.approx(4 * MS * 576, rel=0.01)
    assert cost.verify_seconds(36, 4) == pytest.approx(0.02 * cost.verify(36) / cost.verify(8), rel=0.01)


@pytest.mark.parametrize("guard", [True, False])
def test_a_batch_size_measured_at_one_size_runs_plain_decode(guard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up profiling measured batch 1 only (flat: memory-bound); batch 64 has one point, its prompts' prefill
    (2048 tokens, 8 s). Every verify size at batch 64 is that point times batch 1's flat shape, so the configured
    depth for everyone looks free: the control (no guard) runs it. Guarded, plain decode runs until the batch size
    has two sizes, but for a few requests' exploration (64 candidates on 8 requests) that measures a second size;
    once its plain step is measured (64 tokens, 0.25 s: linear, compute-bound) nobody speculates."""
    if not guard:
        monkeypatch.setattr(CostModel, "knows_batch_size", lambda self, n: True)
    cost = costs(verify=lambda n: 0.06, draft=lambda n: 0.015, state=lambda n: 0.0)
    cost.verify_by_seqs = {Curve.bucket(1): curve(lambda n: 0.06, xs=(1, 9)), Curve.bucket(64): Curve()}
    cost.verify_by_seqs[Curve.bucket(64)].observe(2048, 8.0)
    p = policy(cost)
    reqs = requests(64)
    for r in reqs:
        teach(p, r, 0.8, seed=r.seq_id)
    speculating = sum(1 for s in p.plan(reqs) if s)
    assert speculating <= 8 if guard else speculating == 64, speculating
    cost.verify_by_seqs[Curve.bucket(64)].observe(64, 0.25)
    assert not any(p.plan(reqs))


def test_sampled_steps_of_an_unmeasured_batch_size_are_priced_from_the_greedy_curve_of_that_size() -> None:
    """The sampled curves measured batch 16 only (2 tokens a sequence: 32 tokens for 0.12 s); the greedy curve of
    batch 32 measured its plain step (32 tokens, 0.19 s). A plain sampled step of batch 32 is priced from the
    latter, times the sampled/greedy cost at 32 tokens; without the greedy model to fall back on (the control),
    from batch 16's cheaper steps."""
    greedy, sampled = CostModel(), CostModel()
    for _ in range(3):
        for n, s in ((16, 0.10), (32, 0.12), (64, 0.20)):
            greedy.observe(StepSample(n, s, [], 0.0, False, 16, 0.0))
            sampled.observe(StepSample(n, s * 1.1, [], 0.0, False, 16, 0.0, sampled=True))
        greedy.observe(StepSample(32, 0.19, [], 0.0, False, 32, 0.0))
        greedy.observe(StepSample(64, 0.30, [], 0.0, False, 32, 0.0))
    assert sampled.verify_seconds(32, 32) == pytest.approx(0.132, rel=0.05)  # batch 16's curve: too cheap
    sampled.fallback = greedy
    ratio = max(1.0, sampled.verify(32) / greedy.verify(32))
    assert sampled.verify_seconds(32, 32) == pytest.approx(greedy.verify_seconds(32, 32) * ratio)
    assert sampled.verify_seconds(32, 32) >= 0.19


def test_while_speculating_a_deeper_size_measured_dear_is_measured_again() -> None:
    """Start-up measured 8+ verify tokens at 30 ms (another process ran); really every size costs 10 ms. The policy
    starts on chains of 3 (4 tokens, 10 ms); exploring the configured depth re-measures the deep sizes, and the
    chains deepen. Exploring plain decode only (as it did) left the chain short for good."""
    p = policy(costs(verify=lambda n: 10 * MS if n <= 4 else 30 * MS, draft=lambda n: 1 * MS), explore_every=64,
               explore_min=8)
    req = requests(1)
    teach(p, req[0], 0.95, rounds=200)
    depths = []
    for _ in range(60):
        d = max(map(len, p.plan(req)))
        depths.append(d)
        p.observe_step(StepSample(1 + d, 10 * MS, [1] * d, 1 * MS * d, False, 1, 0.05 * MS))
    assert depths[0] <= 3 and K_MAX in depths[:48] and sorted(depths[-12:])[6] > 4, depths  # (0: plain explored)


def test_the_mean_chosen_depth_counts_a_trees_depth() -> None:
    from engine.core.metrics import SpecDecodingStats

    s = SpecDecodingStats()
    for shape in [(), (1, 1), (2, 1, 1, 1)]:
        s.record_choice(shape)
    assert s.as_dict()["chosen_depths"] == {"0": 1, "2": 1, "tree:2x1x1x1": 1}
    assert s.mean_chosen_depth == pytest.approx((0 + 2 + 4) / 3)


def test_the_drafts_steady_catch_up_is_priced() -> None:
    """A request that speculates every round feeds its draft 1 + P(whole chain accepted) tokens first: the last
    candidate of a fully accepted chain was never forwarded. Where the draft costs in proportion to its tokens
    (a large batch), chains of 1 priced at one token a request look 9 % better than plain decode; priced at
    1 + 0.9 they are 12 % worse, and so is every deeper chain."""
    cost = costs(verify=lambda n: 0.3 + 0.004 * n, draft=lambda n: 0.006 * n)
    p = policy(cost)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.9, seed=r.seq_id)
    assert p.plan(reqs) == [()] * 32


@pytest.mark.parametrize("amortized", [True, False])
def test_a_drafts_catch_up_is_priced_over_the_rounds_its_request_has_left(amortized: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """32 requests whose drafts never saw them (26 tokens to catch up each), acceptance 0.9, verify flat up to 64
    tokens, the draft 2 ms a token. With 990 tokens left the catch-up, spread over their rounds, is small: they
    speculate. With 10 left it is most of what a round would feed the draft: plain decode is faster, and runs.
    The control prices no catch-up (as this policy did): it speculates with 10 tokens left too."""
    if not amortized:
        monkeypatch.setattr(AdaptivePolicy, "_amortized_lag", staticmethod(lambda *a: 1.0))
    p = policy(costs(verify=lambda n: 0.3 if n <= 64 else 0.3 + 0.01 * (n - 64), draft=lambda n: 0.002 * n,
                     state=lambda n: 0.0))
    for max_tokens, speculates in [(1000, True), (20, not amortized)]:
        reqs = requests(32)
        for r in reqs:
            r.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            r.num_cached_draft = 0
            teach(p, r, 0.9, seed=r.seq_id)
        assert any(p.plan(reqs)) == speculates, max_tokens
        for r in reqs:
            p.forget(r.seq_id)


@pytest.mark.parametrize("floor", [0.5, 0.0])
def test_a_dear_plan_predicted_far_slower_is_not_explored(floor: float) -> None:
    """Batch 32, verify flat up to 64 tokens then 10 ms a token more, acceptance 0.6: chains of 1 run (1.2x plain
    decode). The configured depth for everyone (288 verify tokens) is predicted at a fifth of their rate and
    7x their step time: in 300 steps it is never explored, while plain decode (cheap) is. The control
    (``explore_floor`` 0) explores it."""
    verify = lambda n: 0.3 if n <= 64 else 0.3 + 0.01 * (n - 64)  # noqa: E731
    p = policy(costs(verify=verify, draft=lambda n: 0.002 * n, state=lambda n: 0.0), explore_every=256,
               explore_min=8, explore_floor=floor)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.6, seed=r.seq_id)
    depths = []
    for _ in range(300):
        shapes = p.plan(reqs)
        depths.append(max(map(len, shapes)))
        fwd = [sum(len(s) > f for s in shapes) for f in range(depths[-1])]
        t = 32 + sum(len(s) for s in shapes)
        p.observe_step(StepSample(t, verify(t), fwd, 0.002 * sum(fwd), False, 32, 0.0))
    assert depths.count(1) > 250 and 0 in depths, depths
    assert (K_MAX in depths) == (floor == 0), depths


def test_caps_whose_prefixes_were_all_priced_are_not_priced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same chains as pricing every cap (brute force), on random costs and histories; at batch 1 one pass."""
    rng = random.Random(7)
    cases = []
    for _ in range(40):
        slope, flat, draft = rng.uniform(0.0, 1.5), rng.uniform(1, 20), rng.uniform(0.05, 3)
        p = policy(costs(verify=lambda n, s=slope, f=flat: f * MS + s * MS * n, draft=lambda n, d=draft: d * MS))
        reqs = requests(rng.choice([1, 1, 2, 3, 5]))
        for r in reqs:
            teach(p, r, rng.uniform(0.3, 0.98), seed=rng.randrange(10**6))
        cases.append((p, [p._view(r, p.acceptance.engine_rates(True, K_MAX)) for r in reqs]))
    calls = []
    real = AdaptivePolicy._best_prefix
    monkeypatch.setattr(AdaptivePolicy, "_best_prefix", lambda self, *a: calls.append(1) or real(self, *a))
    fast = []
    for p, views in cases:
        calls.clear()
        fast.append((p.best_chains(views), len(calls)))
    monkeypatch.setattr(AdaptivePolicy, "_is_prefix", staticmethod(lambda cut, of: False))
    for (p, views), (plan, n_calls) in zip(cases, fast, strict=True):
        calls.clear()
        brute = p.best_chains(views)
        assert (plan.shapes, plan.tokens, plan.seconds) == (brute.shapes, brute.tokens, brute.seconds)
        if len(views) == 1:
            assert (n_calls, len(calls)) == (1, K_MAX)
    assert any(any(plan.shapes) for plan, _ in fast) and any(not any(plan.shapes) for plan, _ in fast)


def test_the_search_prices_each_size_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caps' searches meet the same draft-forward and verify sizes again; each is priced once per search
    (the curves do not move during it), and the chains found are those of pricing every size each time."""
    p = policy(costs(verify=lambda n: 20 * MS + 0.05 * MS * n, draft=lambda n: 1 * MS + 0.02 * MS * n))
    reqs = requests(32)
    rng = random.Random(3)
    for r in reqs:
        teach(p, r, rng.uniform(0.5, 0.95), seed=r.seq_id)
    views = [p._view(r, p.acceptance.engine_rates(True, K_MAX)) for r in reqs]
    p._cost, p._pinned = p.cost, []
    calls = collections.Counter()  # of the caps' searches (``_best_prefix``)
    searching = [False]
    for name in ("draft_forward", "verify_seconds"):
        real = getattr(p.cost, name)
        monkeypatch.setattr(p.cost, name, lambda *a, real=real, name=name: (
            searching[0] and calls.update([(name, *a)])) or real(*a))
    real_prefix = AdaptivePolicy._best_prefix

    def search(self, *a):
        searching[0] = True
        try:
            return real_prefix(self, *a)
        finally:
            searching[0] = False

    monkeypatch.setattr(AdaptivePolicy, "_best_prefix", search)
    memo_plan = p.best_chains(views)
    assert len(calls) > 50 and max(calls.values()) == 1, calls.most_common(3)
    monkeypatch.setattr(AdaptivePolicy, "_best_prefix", lambda self, rs, cut, base, memo: real_prefix(
        self, rs, cut, base, {}))  # a fresh memo for every cap: sizes priced again
    again = p.best_chains(views)
    assert (again.shapes, again.tokens, again.seconds) == (memo_plan.shapes, memo_plan.tokens, memo_plan.seconds)
    assert any(memo_plan.shapes)


def test_a_size_first_priced_when_speculation_starts_is_not_explored_at_once() -> None:
    """Batch 32, verify 0.2 s + 0.1 s per 32 tokens: at acceptance 0.2 plain decode runs for 150 steps; taught
    0.6, chains of 1 take over. The configured depth for everyone (288 tokens, 1.1 s) was never measured at this
    batch size, and its age used to count from the batch size's first step, so it was due, and run, on the
    first step that speculated (at batch 32 on the larger random pair: one 3.3 s step). It becomes a candidate
    when speculation starts: its age counts from there, so its exploration waits its interval (~40 steps here)
    and still comes."""
    verify = lambda n: 0.2 + 0.1 * n / 32  # noqa: E731
    p = policy(costs(verify=verify, draft=lambda n: 0.001 * n, state=lambda n: 0.0), explore_every=256,
               explore_min=8, explore_floor=0.0)
    reqs = requests(32)
    for r in reqs:
        teach(p, r, 0.2, seed=r.seq_id)
    depths, nodes = [], []
    for step in range(300):
        if step == 150:
            for r in reqs:
                teach(p, r, 0.6, seed=r.seq_id)
        shapes = p.plan(reqs)
        depths.append(max(map(len, shapes)))
        nodes.append(sum(map(len, shapes)))
        fwd = [sum(len(s) > f for s in shapes) for f in range(depths[-1])]
        t = 32 + nodes[-1]
        p.observe_step(StepSample(t, verify(t), fwd, 0.001 * sum(fwd), False, 32, 0.0))
    full = 32 * K_MAX
    assert full not in nodes[:150] and depths[:150].count(0) > 120, depths[:150]
    start = next(i for i in range(150, 300) if nodes[i])  # the first step that speculates
    assert nodes[start:].count(32) > 100, nodes[150:]
    first = nodes.index(full, start) if full in nodes[start:] else None
    assert first is not None and first - start >= 20, (start, first, nodes[150:])
