"""The adaptive policy with several drafting sources (scheduler/adaptive/sources.py): per request per round it
prices the proposer's match (no draft forward) and the fallback draft model (its forwards and catch-up), each with
its own measured acceptance, and gives the round to the better one; without a match and without a model: plain."""

from __future__ import annotations

from scheduler.adaptive import AdaptivePolicy
from scheduler.adaptive.costs import CostModel, Curve, StepLoad, StepTiming
from scheduler.adaptive.plan import DRAFT, real_load
from scheduler.adaptive.sources import Sources
from scheduler.request import Request
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import SpecPolicy, TreeShape
from tests.helpers_adaptive import decoding_requests

MS = 1e-3
MATCH = "suffix"


def _curve(fn, xs=(1, 2, 4, 8, 16, 32, 64)) -> Curve:
    c = Curve()
    for x in xs:
        c.observe(x, fn(x))
    return c


def _costs(draft_ms_per_token: float) -> CostModel:
    """A memory-bound target (20 ms a step, 0.1 ms a token); a draft forward ``draft_ms_per_token`` a token."""
    return CostModel(verify=_curve(lambda n: (20.0 + 0.1 * n) * MS),
                     draft=_curve(lambda n: draft_ms_per_token * n * MS), state=_curve(lambda n: 0.0))




def _policy(draft_ms: float, matches: dict[int, int], fallback_depth: int = 4) -> AdaptivePolicy:
    p = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 8), 4096, 4096), costs=_costs(draft_ms))
    p.sources = Sources(lambda r, cap: min(cap, matches.get(r.seq_id, 0)), MATCH, fallback_depth)
    return p


def _step(policy: AdaptivePolicy, reqs: list[Request], accept: dict[str, int], draft_ms: float) -> list[str]:
    """One step on the stubbed machine: each source accepts ``accept[source]`` candidates. Returns the sources."""
    shapes = policy.plan(reqs)
    sources = [policy.source_of(r.seq_id) if s else "plain" for r, s in zip(reqs, shapes, strict=True)]
    for r, s, src in zip(reqs, shapes, sources, strict=True):
        policy.observe_round(r, tuple(s), min(accept.get(src, 0), len(s)))
    load: StepLoad = real_load([policy._views[r.seq_id] for r in reqs], shapes)
    fwd = [draft_ms * n * MS for n in load.forward_tokens if n > 0]
    policy.observe_step(ScheduledBatch(rounds=reqs, shapes=[tuple(s) for s in shapes]),
                        StepTiming((20.0 + 0.1 * load.verify_tokens) * MS, sum(fwd), 0.0, draft_forward_s=fwd))
    return sources


def test_each_round_goes_to_the_source_priced_best() -> None:
    """Request 0 has a deep match, 1 a short one, 2 none; both sources accept what they propose (the model up to
    3). A cheap draft (0.5 ms a token): the model's 4 candidates beat the short match for request 1 and draft for
    request 2. A costly one (5 ms a token): the matches keep their rounds at no draft cost, and request 2 decodes
    plainly (its model round would lower the batch's rate)."""
    reqs = decoding_requests(3)
    for draft_ms, want in ((0.5, [MATCH, DRAFT, DRAFT]), (5.0, [MATCH, MATCH, "plain"])):
        policy = _policy(draft_ms=draft_ms, matches={0: 8, 1: 2})
        for _ in range(40):
            sources = _step(policy, reqs, {MATCH: 8, DRAFT: 3}, draft_ms=draft_ms)
        assert sources == want, draft_ms
    # No fallback model: a request without a match decodes plainly.
    alone = _policy(draft_ms=0.5, matches={0: 8}, fallback_depth=0)
    for _ in range(20):
        sources = _step(alone, reqs, {MATCH: 8}, draft_ms=0.5)
    assert sources == [MATCH, "plain", "plain"]


def test_a_proposer_that_is_never_accepted_loses_its_rounds_to_the_model() -> None:
    """The choice follows each source's own measured acceptance: matches whose proposals are always rejected
    give way to a cheap draft model that is right."""
    reqs = decoding_requests(2)
    policy = _policy(draft_ms=0.05, matches={0: 8, 1: 8})
    seen = [_step(policy, reqs, {MATCH: 0, DRAFT: 4}, draft_ms=0.05) for _ in range(80)]
    assert seen[-1] == [DRAFT, DRAFT]
    assert policy.match_acceptance.rates(True, 1)[0] < 0.5 < 0.8 < policy.acceptance.rates(True, 1)[0]
