"""The realised-rate veto per drafting source (scheduler/adaptive/realized.py, docs/adaptive.md Realised rates):
with a proposer and a fallback draft model, each source's steps are booked and vetoed on their own, so a draft
model whose rounds measure slower than plain decode does not silence a match whose rounds win (issue 46: on
copy-heavy work the shared veto ran 353 of 704 steps plainly), and the other way round; both losing: plain."""

from __future__ import annotations

from scheduler.adaptive import AdaptiveConfig, AdaptivePolicy
from scheduler.adaptive.costs import CostModel, Curve, StepTiming
from scheduler.adaptive.plan import DRAFT, real_load
from scheduler.adaptive.sources import Sources
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import SpecPolicy, TreeShape

MS = 1e-3
MATCH = "suffix"
PLAIN_RATE = 1 / (20.1 * MS)  # one token a 20 ms step (+ 0.1 ms its row)


def _curve(fn) -> Curve:
    c = Curve()
    for x in (1, 2, 4, 8, 16, 32, 64):
        c.observe(x, fn(x))
    return c


def _world(steps: int, match_depth: int, accept: dict[str, int], hidden_ms: dict[str, float],
           config: AdaptiveConfig | None = None) -> tuple[float, dict[str, int], int]:
    """One greedy request at batch 1 on a memory-bound target (20 ms a step + 0.1 ms a row), a draft at 0.5 ms a
    token. The proposer has a match of ``match_depth`` every other step; each source accepts ``accept[source]``
    of what it proposes. A step drafted from a source also costs the controller ``hidden_ms[source]`` that the one
    controller-time curve (by batch size, shared by every kind of step) cannot tell apart: the curves say both
    sources win. Returns the last half's tokens per second, its rounds by source, and its steps."""
    costs = CostModel(verify=_curve(lambda n: (20.0 + 0.1 * n) * MS), draft=_curve(lambda n: 0.5 * n * MS),
                      state=_curve(lambda n: 0.0))
    policy = AdaptivePolicy(SpecPolicy(TreeShape((1,) * 8), 4096, 4096), costs=costs,
                            config=config or AdaptiveConfig())
    clock = [0]
    policy.sources = Sources(lambda r, cap: min(cap, match_depth) if clock[0] % 2 == 0 else 0, MATCH, 4)
    r = Request(0, "0", [1] * 16, SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
    r.output_token_ids = [2]
    r.num_cached_target = r.num_cached_draft = r.num_tokens - 1
    tokens = seconds = 0.0
    rounds = {MATCH: 0, DRAFT: 0, "plain": 0}
    for step in range(steps):
        clock[0] = step
        shape = tuple(policy.plan([r])[0])
        src = policy.source_of(r.seq_id) if shape else "plain"
        accepted = min(accept.get(src, 0), len(shape))
        policy.observe_round(r, shape, accepted)
        load = real_load([policy._views[r.seq_id]], [shape])
        fwd = [0.5 * n * MS for n in load.forward_tokens if n > 0]
        timing = StepTiming((20.0 + 0.1 * load.verify_tokens) * MS, sum(fwd), hidden_ms.get(src, 0.0) * MS,
                            draft_forward_s=fwd)
        policy.observe_step(ScheduledBatch(rounds=[r], shapes=[shape]), timing)
        if step >= steps // 2:
            tokens += accepted + 1
            seconds += timing.verify_s + timing.draft_s + timing.state_s
            rounds[src] += 1
    return tokens / seconds, rounds, steps - steps // 2


def test_a_losing_model_does_not_silence_a_winning_match() -> None:
    """The match (depth 2, both accepted: 3 tokens a 20 ms step) wins; the model's rounds (4 tokens) hide 200 ms
    of controller time each, so they lose. Booked together the speculative steps measure slower than plain decode
    and the old shared veto decoded everything plainly (~1.0x plain); per source the model is vetoed and the match
    keeps speculating on nearly every step it has (~2x plain: its steps at 3 tokens, the others plain)."""
    rate, rounds, steps = _world(800, 2, {MATCH: 2, DRAFT: 3}, {DRAFT: 200.0})
    assert rounds[MATCH] >= 0.9 * steps / 2, rounds
    assert rounds[DRAFT] <= 0.05 * steps, rounds
    assert rate >= 1.8 * PLAIN_RATE, (rate / PLAIN_RATE, rounds)


def test_a_losing_match_gives_its_rounds_to_a_winning_model() -> None:
    """Symmetric: the match (depth 8, all accepted) hides 300 ms a round and loses; the model (4 tokens a round,
    no hidden cost) wins. Per source the match is vetoed and its requests fall back to the model, which then
    drafts nearly every step (~3.5x plain); the shared veto decoded plainly."""
    rate, rounds, steps = _world(800, 8, {MATCH: 8, DRAFT: 3}, {MATCH: 300.0})
    assert rounds[DRAFT] >= 0.9 * steps, rounds
    assert rounds[MATCH] <= 0.05 * steps, rounds
    assert rate >= 3.0 * PLAIN_RATE, (rate / PLAIN_RATE, rounds)


def test_both_sources_losing_decode_plainly() -> None:
    """Both hide 100 ms a round and lose (a match step at 3 tokens: 0.6x plain; a model step at 4: 0.8x):
    plain decode but for each source's probes (each backs off to one per ``probe_every`` steps), >= 0.95x."""
    rate, rounds, steps = _world(800, 2, {MATCH: 2, DRAFT: 3}, {MATCH: 100.0, DRAFT: 100.0})
    assert rounds["plain"] >= 0.97 * steps, rounds
    assert rate >= 0.95 * PLAIN_RATE, (rate / PLAIN_RATE, rounds)
