"""Self-speculation (method layer_skip) under the adaptive policy (``adaptive: true``): greedy output equals no
speculation, the policy learns the target's own draft passes as a draft's forwards (one measured time per depth),
and it decodes plainly where the (stubbed) costs say drafting loses, deeply where they say it wins."""

from __future__ import annotations

import dataclasses

import pytest

from engine.llm import LLM
from scheduler.adaptive import AdaptivePolicy
from scheduler.adaptive.costs import CostModel, Curve
from scheduler.sampling_params import SamplingParams

TARGET = "engine/default_models/target"
PROMPTS = [[1] + list(range(20, 32)), [1, 17, 44, 9, 83], [1]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MS = 1e-3


def _layer_skip(**kw) -> dict:
    return {"method": "layer_skip", "exit_layer": 3, "num_speculative_tokens": 4, "adaptive": True,
            "adaptive_cost_cache": False, **kw}


def _greedy(spec: dict | None) -> list[list[int]]:
    with LLM(TARGET, spec, max_num_seqs=4) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_greedy_with_adaptive_layer_skip_equals_no_speculation(monkeypatch: pytest.MonkeyPatch) -> None:
    want = _greedy(None)
    llm = LLM(TARGET, _layer_skip(adaptive_warmup_s=1.0), max_num_seqs=4)
    try:
        policy = llm.engine.scheduler.policy
        assert isinstance(policy, AdaptivePolicy)
        # measured, never assumed free (the draftless methods' proposals are priced at zero)
        assert policy.costs.draft.ready and min(p.y for p in policy.costs.draft.points.values()) > 0
        timings = []
        observe = policy.observe_step
        monkeypatch.setattr(policy, "observe_step", lambda b, t: (timings.append((list(b.shapes), t)),
                                                                  observe(b, t))[1])
        policy.config = dataclasses.replace(policy.config, min_rounds=0)
        for _ in range(2):  # the policy learns across runs; the output never changes
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        drafting = [(max(map(len, shapes)), t) for shapes, t in timings if any(shapes) and t.draft_forward_s]
        # each drafting step timed one forward per depth (the target's own early-layer passes), within its draft time
        assert drafting and all(len(t.draft_forward_s) == depth and min(t.draft_forward_s) > 0
                                and sum(t.draft_forward_s) <= t.draft_s for depth, t in drafting), drafting
    finally:
        llm.shutdown()


def _curve(fn) -> Curve:
    c = Curve()
    for x in (1, 2, 4, 8, 16, 32, 64):
        c.observe(x, fn(x))
    return c


STUBS = {  # (verify seconds(tokens), one draft pass's seconds(tokens))
    "drafting-loses": (lambda n: 8 * MS, lambda n: 6 * MS),  # a pass nearly a decode step: never worth it
    "drafting-wins": (lambda n: 8 * MS, lambda n: 0.05 * MS),  # passes almost free: the deepest chains
}


@pytest.mark.parametrize("stub", sorted(STUBS))
def test_the_policy_prices_the_passes_at_their_stubbed_cost(monkeypatch: pytest.MonkeyPatch, stub: str) -> None:
    llm = LLM(TARGET, _layer_skip(adaptive_warmup_s=0), max_num_seqs=4)
    try:
        policy = llm.engine.scheduler.policy
        verify, draft = STUBS[stub]
        for name in ("costs", "sampled_costs"):
            setattr(policy, name, CostModel(verify=_curve(verify), draft=_curve(draft),
                                            state=_curve(lambda n: 0.01 * MS)))
        monkeypatch.setattr(policy, "observe_step", lambda batch, timing: None)  # the stubbed costs stay
        policy.config = dataclasses.replace(policy.config, min_rounds=0, explore_budget=1e-6)
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        rounds = llm.engine.stats.num_rounds
    finally:
        llm.shutdown()
    assert got == _greedy(None)
    if stub == "drafting-loses":
        assert rounds == 0
    else:
        assert rounds > 0


def test_the_passes_start_unpriced_not_free() -> None:
    """The draftless methods' proposals are seeded as free (they cost the controller, no forward); layer_skip's
    draft passes are forwards of the target, so the policy starts them unmeasured (its warm-up measures them)."""
    from engine.core.config import SpeculativeConfig
    from engine.core.policy_warmup import build_policy

    spec = SpeculativeConfig.parse(_layer_skip())
    policy = build_policy(spec, spec.tree_shape, 512, 512)
    assert not policy.costs.draft.ready and not policy.sampled_costs.draft_call.ready
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "adaptive": True})
    assert build_policy(ngram, ngram.tree_shape, 512, 512).costs.draft(1) == 0.0
