"""The draft in a local process of its own (engine/execution/draft_process.py): same outputs, pinned cores, a dead draft
process noticed at once and replaced."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.execution.faults import WorkerDiedError
from tests.conftest import spec

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]
CORES = sorted(os.sched_getaffinity(0))
# One core per role where the machine has two; else both on the one core (still two processes).
PINNED = {"draft_cores": [CORES[-1]], "target_cores": [CORES[0]]}


def _run(target: str, cfg: dict, params: SamplingParams, force=None) -> tuple[list[list[int]], dict | None]:
    with LLM(target, speculative_config=cfg) as llm:
        seen: set[tuple[frozenset[int], bool]] = set()
        if force is not None:
            llm.engine.pipeline.switch.force = force
        if cfg.get("draft_process"):
            ex = llm.engine.executor
            assert os.sched_getaffinity(ex._proc.pid) == set(PINNED["draft_cores"])  # the child is pinned
            step = ex.target.step

            def pinned_step(msg):  # where the target's forwards run, and whether the draft was working meanwhile
                seen.add((frozenset(os.sched_getaffinity(0)), ex._in_flight))
                return step(msg)

            ex.target.step = pinned_step
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.pipeline.stats.as_dict() if llm.engine.pipeline is not None else None
        if cfg.get("draft_process"):
            # Beside a working draft, the target keeps to its cores; while the draft waits, it has both roles'.
            both = frozenset(PINNED["target_cores"] + PINNED["draft_cores"])
            assert (frozenset(PINNED["target_cores"]), True) in seen
            assert seen <= {(frozenset(PINNED["target_cores"]), True), (both, False)}, seen
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    pytest.param(SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=13,
                                                                ignore_eos=True), marks=pytest.mark.slow)],
                         ids=["greedy", "seeded"])
def test_outputs_identical_with_the_draft_in_its_own_process(llama, params):
    before = os.sched_getaffinity(0)
    cfg = spec(llama.perturbed, branching=[2, 1, 1])
    off, _ = _run(llama.target, cfg, params)
    on, stats = _run(llama.target, {**cfg, "pipeline": True, "pipeline_switch": False, "pipeline_width": 3,
                                    "draft_process": True, **PINNED}, params)
    assert on == off
    assert 0 < stats["hits"] <= stats["predrafted_rounds"]  # the pre-drafted trees came from the child
    assert os.sched_getaffinity(0) == before  # pinned for the target's forwards only


@pytest.mark.slow
def test_switching_with_the_draft_in_its_own_process(llama):
    """Steps forced pipelined and sequential in turn, the draft in its own process: outputs as without
    pipelining (sequential steps verify on both roles' cores, pipelined ones on the target's)."""
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=13, ignore_eos=True)
    cfg = spec(llama.perturbed, branching=[2, 1, 1])
    off, _ = _run(llama.target, cfg, seeded)
    on, stats = _run(llama.target, {**cfg, "pipeline": True, "draft_process": True, **PINNED}, seeded,
                     force=lambda i: i % 6 in (0, 1, 4))
    assert on == off
    assert 0 < stats["pipelined_fraction"] < 1 and stats["hits"] > 0


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=13, ignore_eos=True)


@pytest.mark.slow
def test_a_dead_draft_process_is_replaced_and_outputs_do_not_change(llama):
    # SIGKILL the child mid-job: noticed at once, the engine decodes greedy requests without speculation while a
    # new child loads, holds the seeded sampled ones (their tokens depend on the draft's trees), then speculates
    # again; every output is as without the fault.
    cfg = {**spec(llama.perturbed, branching=[2, 1, 1]), "pipeline": True, "pipeline_switch": False}
    params = [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS)
    with LLM(llama.target, speculative_config=cfg) as llm:  # the reference: the draft in a thread, no fault
        reference = [o.token_ids for o in llm.generate(PROMPTS + PROMPTS, params)]
    with LLM(llama.target, speculative_config={**cfg, "draft_process": True}) as llm:
        engine, ex = llm.engine, llm.engine.executor
        old_pid = ex.describe()["draft_pid"]
        reqs = [engine.add_request(str(i), p, params[i]) for i, p in enumerate(PROMPTS + PROMPTS)]
        seeded = reqs[len(PROMPTS):]
        outs: dict[str, list[int]] = {}
        submit, calls = ex.submit_draft, []

        def submit_then_die(msg):  # the child dies with a draft call in hand (its third)
            submit(msg)
            calls.append(time.monotonic())
            if len(calls) == 3:
                os.kill(old_pid, signal.SIGKILL)

        ex.submit_draft = submit_then_die
        step, trees = ex.target.step, []

        def verify(msg):  # the tree ids the verifier takes laws for, by the draft generation that is up
            trees.extend((ex.describe()["draft_generation"], s.tree_id) for s in msg.seqs if s.tree_id >= 0)
            return step(msg)

        ex.target.step = verify
        deadline = time.monotonic() + 60
        while not engine.recovery.stats.failures:
            assert time.monotonic() < deadline, "the dead draft process was not noticed"
            for o in engine.step_finished():
                outs[o.request_id] = o.token_ids
        assert engine.recovery.stats.noticed_at[0] - calls[2] < 5  # noticed, not waited for
        assert not engine.draft_up and engine.recovery.degraded
        held = [len(r.output_token_ids) for r in seeded]
        while engine.has_unfinished or engine.recovery.degraded:
            assert time.monotonic() < deadline, "the job did not finish in time"
            if not engine.has_unfinished:  # keep the engine stepping until the new child is up
                engine.add_request(f"filler-{time.monotonic()}", PROMPTS[0], GREEDY)
            down = not engine.draft_up
            for o in engine.step_finished():
                outs[o.request_id] = o.token_ids
            if down and not engine.draft_up:  # a step with the draft down gave the seeded requests nothing
                assert [len(r.output_token_ids) for r in seeded] == held
        assert [outs[str(i)] for i in range(len(params))] == reference  # greedy and seeded
        assert engine.recovery.stats.restarts == {"draft": 1} and engine.draft_up
        assert "the draft process exited" in engine.recovery.stats.failures[0]
        # The dead child's trees failed, only those: the new one numbers its trees from 1 << 40, taken as usual.
        assert ex.target.law_store._lost_below == 1 << 40
        assert {g for g, _ in trees} == {1, 2} and all((t >= 1 << 40) == (g == 2) for g, t in trees)
        new_pid = ex.describe()["draft_pid"]
        assert new_pid != old_pid and ex._proc.poll() is None
        accepted = engine.stats.num_accepted
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == reference[0]
        assert engine.stats.num_accepted > accepted  # the new child's trees are verified and accepted
        with pytest.raises(RuntimeError, match="target runs in the engine's own process"):
            ex.begin_restart("target")  # it dies with us: nothing to restart apart from the engine
        ex.begin_restart("draft")  # a replacement that dies while starting: noticed, not waited for
        os.kill(ex.describe()["draft_pid"], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="exited while starting"):
            ex.finish_restart("draft", block=True)
        assert time.monotonic() - start < 5


def test_bad_cores_are_refused_naming_the_field(llama):
    with pytest.raises(ValueError, match="draft_cores"):
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "draft_process": True,
                                               "draft_cores": [4095]})
    with pytest.raises(ValueError, match="target_cores"):
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "target_cores": []})
    with pytest.raises(ValueError, match="need draft_process"):  # pinning the in-process thread is not offered
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "draft_cores": [0]})
