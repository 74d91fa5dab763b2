"""The adaptive policy against a machine its cost curves cannot fully see (scheduler/adaptive/realized.py): a
speculative step that measures slower than plain decode loses to it, whatever the curves predict."""

from __future__ import annotations

import pytest

from scheduler.adaptive import AdaptiveConfig, AdaptivePolicy
from scheduler.adaptive.costs import StepLoad, StepTiming
from scheduler.adaptive.plan import DRAFT
from scheduler.adaptive.realized import RealizedRates
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import SpecPolicy, TreeShape
from tests.helpers_adaptive import decoding_requests

MS = 1e-3




def _world(policy: AdaptivePolicy, steps: int, hidden_ms: float) -> tuple[float, float, list[bool]]:
    """A target at 30 ms a step + 0.2 ms a token, a draft at 1 ms a token, the first candidate always accepted and
    the second never; a step with any speculative round also costs the controller ``hidden_ms`` (bookkeeping that
    the one controller-time curve, by batch size, shares with plain steps). Returns the tokens and seconds of the
    last half, and which steps speculated."""
    reqs = decoding_requests(4)
    tokens = seconds = 0.0
    speculated = []
    for step in range(steps):
        shapes = policy.plan(reqs)
        load = StepLoad()
        for s in shapes:
            load.add(1, 1, s)  # one token in flight; the draft has seen all but the last
        fwd = [1.0 * n * MS for n in load.forward_tokens if n > 0]
        spec = any(shapes)
        timing = StepTiming((30.0 + 0.2 * load.verify_tokens) * MS, sum(fwd), hidden_ms * MS * spec,
                            draft_forward_s=fwd)
        emitted = 0
        for r, s in zip(reqs, shapes, strict=True):
            accepted = min(1, len(s))
            policy.observe_round(r, tuple(s), accepted)
            emitted += accepted + 1
        policy.observe_step(ScheduledBatch(rounds=reqs, shapes=[tuple(s) for s in shapes]), timing)
        speculated.append(spec)
        if step >= steps // 2:
            tokens += emitted
            seconds += timing.verify_s + timing.draft_s + timing.state_s
    return tokens, seconds, speculated


PLAIN_RATE = 4 / ((30.0 + 0.2 * 4) * MS)  # four requests decoding plainly


def test_speculation_that_measures_slower_than_plain_decode_is_not_chosen() -> None:
    """40 ms of hidden controller time per speculative step: depth 1 emits 2 tokens a round for 35.6 + 40 ms
    against plain decode's 1 for 30.8 ms, so plain decode is faster, though the curves (whose controller time is
    shared by both kinds of step) say otherwise. With the realised-rate check disabled (``realized_min_steps``
    past any run) the policy speculates and runs ~0.8x plain decode (what this test shows failing); with it, it
    decodes plainly but for explorations."""
    policy = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 4), 4096, 4096))
    tokens, seconds, spec = _world(policy, 400, hidden_ms=40.0)
    assert tokens / seconds >= 0.97 * PLAIN_RATE
    assert sum(spec[200:]) <= 0.15 * 200

    blind = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 4), 4096, 4096), config=AdaptiveConfig(realized_min_steps=1e9))
    tokens, seconds, spec = _world(blind, 400, hidden_ms=40.0)
    assert tokens / seconds < 0.9 * PLAIN_RATE and sum(spec[200:]) > 100  # what the realised rates prevent


def test_speculation_that_pays_is_kept_and_a_veto_lifts_when_acceptance_rises() -> None:
    """No hidden cost: depth 1 is ~1.6x plain decode and stays chosen. After a stretch where nothing is accepted
    (speculation measured slower), the explorations see acceptance return and the policy speculates again."""
    policy = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 4), 4096, 4096))
    tokens, seconds, spec = _world(policy, 400, hidden_ms=0.0)
    assert tokens / seconds >= 1.4 * PLAIN_RATE
    assert sum(spec[200:]) >= 0.9 * 200
    _world(policy, 300, hidden_ms=40.0)
    tokens, seconds, spec = _world(policy, 400, hidden_ms=0.0)
    assert sum(spec[200:]) >= 0.9 * 200 and tokens / seconds >= 1.4 * PLAIN_RATE


def test_realised_rates_compare_the_kinds_per_batch_size() -> None:
    r = RealizedRates(AdaptiveConfig(realized_min_steps=3.0, realized_decay=0.9))
    for _ in range(2):
        r.observe(1, [DRAFT], tokens=1.0, seconds=1.0)
        r.observe(1, [], tokens=2.0, seconds=1.0)
    assert r.rate(1, DRAFT) is None and r.loss(1) == 0.0  # too few steps to judge
    for _ in range(2):
        r.observe(1, [DRAFT], tokens=1.0, seconds=1.0)
        r.observe(1, [], tokens=2.0, seconds=1.0)
    assert r.rate(1, DRAFT) == pytest.approx(1.0) and r.loss(1) == pytest.approx(0.5)  # half a step (1 s each)
    r.observe(1, [DRAFT], tokens=3.0, seconds=3.0)  # a longer speculative step: its loss in plain steps grows
    assert r.loss(1) > 0.5
    assert r.loss(64) == 0.0  # another batch-size bucket: its own evidence
    before = r.rate(1, DRAFT)
    r.observe(1, [DRAFT], tokens=0.0, seconds=1.0)  # nothing emitted: not a step to learn from
    assert r.rate(1, DRAFT) == before
