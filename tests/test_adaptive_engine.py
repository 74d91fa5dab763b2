"""The adaptive policy inside the engine: start-up profiling, and seeded sampled output that does not depend on
what the policy measured (tiny random checkpoints, in-process workers)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.llm import LLM
from scheduler.adaptive import AdaptivePolicy
from scheduler.adaptive.costs import CostModel, Curve
from scheduler.sampling_params import SamplingParams
from tests.conftest import spec

K = 4
PROMPTS = [[1, 33, 34, 35], [1, 5], [1, 9, 9, 9, 9]]
MS = 1e-3


def _curve(fn) -> Curve:
    c = Curve()
    for x in (1, 2, 4, 8, 16, 32, 64, 128):
        c.observe(x, fn(x))
    return c


def _costs(verify, draft) -> CostModel:
    return CostModel(verify=_curve(verify), draft=_curve(draft), state=_curve(lambda n: 0.01 * MS))


FORCED = {"memory_bound": (lambda n: 10 * MS, lambda n: 0.1 * MS),  # -> the deepest chains
          "compute_bound": (lambda n: 1 * MS * n, lambda n: 0.5 * MS * n)}  # -> K = 0


def _outputs(llama, costs: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], dict]:
    llm = LLM(llama.target, {**spec(llama.perturbed, K, adaptive=True), "adaptive_warmup_s": 0}, block_size=4)
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, AdaptivePolicy)
    policy.costs = _costs(*FORCED[costs])
    policy.sampled_costs = _costs(*FORCED[costs])
    monkeypatch.setattr(policy, "observe_step", lambda batch, timing: None)  # the forced costs stay
    # Free choices from the first round: the unseeded request's rounds are random, and with the usual 8-round
    # wait it sometimes finished before the policy chose anything for it (both runs then looked the same).
    policy.config = dataclasses.replace(policy.config, min_rounds=0)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True),  # pinned
              SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True),  # unseeded: adaptive
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]  # greedy: adaptive
    out = [o.token_ids for o in llm.generate(PROMPTS, params)]
    depths = llm.engine.stats.as_dict()["chosen_depths"]
    llm.shutdown()
    return out, depths


def test_seeded_sampled_output_does_not_depend_on_the_measured_costs(llama, monkeypatch: pytest.MonkeyPatch) -> None:
    deep, deep_depths = _outputs(llama, "memory_bound", monkeypatch)
    flat, flat_depths = _outputs(llama, "compute_bound", monkeypatch)
    # The two policies really chose differently: plain decode for the unpinned under linear costs.
    assert deep_depths != flat_depths and "0" in flat_depths, (deep_depths, flat_depths)
    assert deep[0] == flat[0]  # seeded, sampled: the configured depth in both
    assert deep[2] == flat[2]  # greedy: any depth gives the target's argmax


def test_without_pinning_the_seeded_output_would_differ(llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a seeded request planned like the others gets other tokens (so the test above has power)."""
    monkeypatch.setattr(AdaptivePolicy, "pinned", staticmethod(lambda req: False))
    deep, _ = _outputs(llama, "memory_bound", monkeypatch)
    flat, _ = _outputs(llama, "compute_bound", monkeypatch)
    assert deep[0] != flat[0]


def test_start_up_profiling_seeds_both_regimes_and_leaves_no_trace(llama) -> None:
    with LLM(llama.target, {**spec(llama.perturbed, K, adaptive=True), "adaptive_warmup_s": 5,
                            "adaptive_cost_cache": False}, block_size=4, max_num_seqs=16) as llm:
        engine = llm.engine
        policy = engine.scheduler.policy
        assert policy.costs.ready and policy.sampled_costs.ready
        assert len(policy.costs.verify.points) >= 3 and policy.costs.draft_call.ready
        assert len(policy.costs.draft_by_seqs) >= 2  # the draft's forwards, by the sequences each carried
        # Nothing of the dummy sequences remains: statistics, acceptance, requests, the forced shape.
        assert engine.stats.num_rounds == 0 and engine.times.steps == 0 and not engine.has_unfinished
        assert policy.acceptance.rates(True, 1) == [0.7] and policy.forced is None
        assert not engine.scheduler.running and not engine.scheduler.waiting
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    with LLM(llama.target, None, block_size=4) as plain:
        assert got == [o.token_ids for o in plain.generate(PROMPTS, greedy)]


def test_plain_steps_make_no_draft_call_and_greedy_output_stays_the_targets(llama, monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    """A step where every round is plain (K = 0) does not call the draft; the commits and dropped ids it would
    have carried go with the next call. Rounds alternate plain and speculative here (the draft's lag caught up
    each time), requests finish between calls, and greedy output equals the target's without speculation."""
    llm = LLM(llama.target, {**spec(llama.perturbed, K, adaptive=True), "adaptive_warmup_s": 0}, block_size=4)
    engine = llm.engine
    policy = engine.scheduler.policy
    steps = {"plain": 0, "drafting": 0}
    plans = []

    def plan(reqs, prefill=False):
        plans.append(len(reqs))
        speculate = len(plans) % 3 == 0  # two plain steps, then one that drafts
        return [(1,) * min(K, policy.base.cap(r)) if speculate else () for r in reqs]

    calls = []
    submit = engine.executor.submit_draft
    monkeypatch.setattr(policy, "plan", plan)
    monkeypatch.setattr(engine.executor, "submit_draft", lambda msg: (calls.append(msg), submit(msg))[1])
    step = engine._step

    def counted() -> None:
        batch_before = len(calls)
        step()
        steps["drafting" if len(calls) > batch_before else "plain"] += 1

    monkeypatch.setattr(engine, "_step", counted)
    samples = []
    observe = policy.observe_step
    monkeypatch.setattr(policy, "observe_step", lambda b, t: (samples.append((list(b.shapes), t)), observe(b, t))[1])
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 17, 24)]
    got = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    got += [o.token_ids for o in llm.generate(PROMPTS[:2], greedy[:2])]  # the first batch's dropped ids travel
    llm.shutdown()
    assert steps["plain"] >= 10 and all(m.seqs or m.prefills for m in calls), (steps, len(calls))
    assert any(m.finished for m in calls)
    # the draft worker timed each forward of a drafting step apart (the cost model prices each at its size)
    drafting = [(max(map(len, shapes)), t) for shapes, t in samples if any(shapes)]
    assert drafting and all(len(t.draft_forward_s) == depth and min(t.draft_forward_s) > 0
                            and sum(t.draft_forward_s) <= t.draft_s for depth, t in drafting)
    assert all(not t.draft_forward_s for shapes, t in samples if not any(shapes))
    with LLM(llama.target, None, block_size=4) as plain:
        want = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
        want += [o.token_ids for o in plain.generate(PROMPTS[:2], greedy[:2])]
    assert got == want


def test_the_draft_sees_a_prompt_only_when_its_request_first_speculates(llama, monkeypatch: pytest.MonkeyPatch
                                                                        ) -> None:
    """An adaptive engine does not prefill the draft: at saturation it plans K = 0 for everyone and the draft's
    prefill would be work for nothing. Planned plain throughout, the draft is never called; a request that starts
    speculating later feeds the draft its whole prefix in its first round, and greedy output stays the target's
    (a draft that skipped the prompt would propose from the wrong context: fewer accepted tokens, caught below)."""
    llm = LLM(llama.target, {**spec(llama.perturbed, K, adaptive=True), "adaptive_warmup_s": 0}, block_size=4)
    engine = llm.engine
    policy = engine.scheduler.policy
    assert engine.scheduler.lazy_draft_prefill
    calls = []
    submit = engine.executor.submit_draft
    monkeypatch.setattr(engine.executor, "submit_draft", lambda msg: (calls.append(msg), submit(msg))[1])
    speculate = {"on": False}
    monkeypatch.setattr(policy, "plan", lambda reqs, prefill=False: [
        (1,) * min(K, policy.base.cap(r)) if speculate["on"] else () for r in reqs])
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert calls == []  # no prefill, no rounds: the draft did nothing
    speculate["on"] = True
    spec_out = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    assert all(not m.prefills for m in calls) and calls[0].seqs[0].base_len == 0  # the whole prefix, in a round
    accepted = engine.stats.as_dict()["mean_acceptance_length"]
    llm.shutdown()
    with LLM(llama.target, None, block_size=4) as ref:
        want = [o.token_ids for o in ref.generate(PROMPTS, greedy)]
    assert plain == want and spec_out == want
    assert accepted > 2.0  # the perturbed draft accepts most tokens only when it saw the prompt


def test_a_restart_of_the_same_setup_takes_the_cached_profile(llama, tmp_path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The first engine profiles and writes its curves; a second one of the same setup reads them instead of
    profiling, with the same greedy output; another setup, a cache turned off, and an unreadable file profile."""
    import engine.core.policy_warmup as warmup

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    profiled: list[int] = []
    real_profile = warmup.profile
    monkeypatch.setattr(warmup, "profile", lambda *a: profiled.append(1) or real_profile(*a))
    cfg = {**spec(llama.perturbed, K, adaptive=True), "adaptive_warmup_s": 1}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def start(config: dict, max_num_seqs: int = 8) -> tuple[dict, list[list[int]]]:
        with LLM(llama.target, config, block_size=4, max_num_seqs=max_num_seqs) as llm:
            policy = llm.engine.scheduler.policy
            curves = {"greedy": policy.costs.to_dict(), "sampled": policy.sampled_costs.to_dict()}
            return curves, [o.token_ids for o in llm.generate(PROMPTS, greedy)]

    first, out = start(cfg)
    (path,) = tmp_path.glob("policy-costs-*.json")
    assert profiled == [1] and first["greedy"]["verify"]["points"]
    kept = {k: v for k, v in json.loads(path.read_text()).items() if k != "format"}  # as the first one left it
    again, out_again = start(cfg)
    assert profiled == [1]  # not profiled: read from the file
    assert again == kept
    assert out_again == out
    start(cfg, max_num_seqs=4)  # another setup: its own profile
    assert len(profiled) == 2 and len(list(tmp_path.glob("policy-costs-*.json"))) == 2
    start({**cfg, "adaptive_cost_cache": False})
    assert len(profiled) == 3
    path.write_text('{"format": 1, "greedy": {"verify": {"points": [[0, "x", 1]]}}}')  # not ours: ignored
    start(cfg)
    assert len(profiled) == 4 and json.loads(path.read_text())["greedy"]["verify"]["points"]  # and rewritten


def test_the_profiling_measures_what_any_plan_needs_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget that runs out after a few groups (a slow model) still leaves each regime's curves able to price a
    plan: per batch size (one per log2 bucket: 1, 2, 4, ...), plain decode and the short chain of the greedy
    regime, then of the sampled one, before the next batch size; then the configured shape. Plain decode of both
    regimes first (as this was once) left a 3 s budget on the larger random pair with one verify size and no
    draft forward: the policy could not plan. Batch sizes in powers of 4 (as this was until 12-04d) left batch 32
    unmeasured, and on the built-in pair batch 64 too: the policy decoded plainly at a batch size it had not
    measured (18 steps of the first group at batch 64, and every group's tail through batch 23-45) until an
    exploration measured a second size there."""
    from types import SimpleNamespace

    import engine.core.policy_warmup as warmup
    from scheduler.spec_policy import SpecPolicy, TreeShape

    clock = {"t": 0.0}
    groups: list[tuple[int, float, int, int]] = []

    def group(engine, policy, rng, batch, temperature, depth, rounds=None) -> int:
        rounds = policy.config.profile_rounds if rounds is None else rounds
        groups.append((batch, temperature, depth, rounds))
        clock["t"] += 1.0  # each group takes a second
        return 1

    monkeypatch.setattr(warmup, "_group", group)
    monkeypatch.setattr(warmup, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    fake = SimpleNamespace(max_model_len=1024, config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=16)),
                           reset_stats=lambda: None)
    policy = AdaptivePolicy(SpecPolicy(TreeShape((2, 1, 1, 1)), 1024, 1024))
    warmup.profile(fake, policy, 4.5)
    assert groups[0] == (1, 0.0, 4, 1)  # the one-off costs: one round of the configured shape, forgotten
    assert groups[1:5] == [(1, 0.0, 0, 4), (1, 0.0, 2, 4), (1, 0.8, 0, 4), (1, 0.8, 2, 4)], groups
    assert len(groups) == 5  # the budget's end
    groups.clear()
    clock["t"] = 0.0
    warmup.profile(fake, policy, 100.0)
    sizes = (1, 2, 4, 8, 16)
    assert [g[:3] for g in groups[1:21]] == [(b, t, d) for b in sizes for t in (0.0, 0.8) for d in (0, 2)]
    assert [g[:3] for g in groups[21:]] == [(b, t, 4) for b in sizes for t in (0.0, 0.8)]


def test_cost_curves_survive_a_round_trip_and_bad_points_are_refused() -> None:
    m = _costs(lambda n: 2 * MS + 0.1 * MS * n, lambda n: 0.3 * MS * n)
    m.verify_by_seqs[2] = _curve(lambda n: 3 * MS * n)
    m.draft_by_seqs[5] = _curve(lambda n: 9 * MS + 0.5 * MS * n)
    back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    for x in (1, 3, 50, 300):
        assert back.verify_seconds(x, 4) == m.verify_seconds(x, 4)
        assert back.draft_seconds([x, x], [32, 8]) == m.draft_seconds([x, x], [32, 8]) > m.draft_seconds([x, x], [])
    for bad in ([[3, 1.0, 0.5]],  # the point is not in its bucket
                [[0, 1.0, float("nan")]], [[0, 1.0, -1.0]], [[0, "1", 0.5]], [[0, 1.0, 0.5, 0]]):
        with pytest.raises(ValueError):
            CostModel.from_dict({**m.to_dict(), "verify": {"points": bad}})
