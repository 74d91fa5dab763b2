"""The draft in a local process of its own (engine/draft_process.py): same outputs, pinned cores, a dead draft
noticed at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.faults import WorkerDiedError
from tests.conftest import spec

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]
CORES = sorted(os.sched_getaffinity(0))
# One core per role where the machine has two; else both on the one core (still two processes).
PINNED = {"draft_cores": [CORES[-1]], "target_cores": [CORES[0]]}


def _run(target: str, cfg: dict, params: SamplingParams) -> tuple[list[list[int]], dict | None]:
    with LLM(target, speculative_config=cfg) as llm:
        seen: set[frozenset[int]] = set()
        if cfg.get("draft_process"):
            ex = llm.engine.executor
            assert os.sched_getaffinity(ex._proc.pid) == set(PINNED["draft_cores"])  # the child is pinned
            step = ex.target.step

            def pinned_step(msg):  # where the target's forwards run
                seen.add(frozenset(os.sched_getaffinity(0)))
                return step(msg)

            ex.target.step = pinned_step
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.pipeline.stats.as_dict() if llm.engine.pipeline is not None else None
        if cfg.get("draft_process"):
            assert seen == {frozenset(PINNED["target_cores"])}
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=13,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_outputs_identical_with_the_draft_in_its_own_process(llama, params):
    before = os.sched_getaffinity(0)
    cfg = spec(llama.perturbed, branching=[2, 1, 1])
    off, _ = _run(llama.target, cfg, params)
    on, stats = _run(llama.target, {**cfg, "pipeline": True, "pipeline_width": 3, "draft_process": True,
                                    **PINNED}, params)
    assert on == off
    assert 0 < stats["hits"] <= stats["predrafted_rounds"]  # the pre-drafted trees came from the child
    assert os.sched_getaffinity(0) == before  # pinned for the target's forwards only


def test_a_dead_draft_process_is_noticed_not_waited_for(llama):
    llm = LLM(llama.target, speculative_config={**spec(llama.perturbed, k=3), "pipeline": True,
                                                 "draft_process": True})
    try:
        os.kill(llm.engine.executor._proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="draft"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def test_bad_cores_are_refused_naming_the_field(llama):
    with pytest.raises(ValueError, match="draft_cores"):
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "draft_process": True,
                                               "draft_cores": [4095]})
    with pytest.raises(ValueError, match="target_cores"):
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "target_cores": []})
    with pytest.raises(ValueError, match="need draft_process"):  # pinning the in-process thread is not offered
        LLM(llama.target, speculative_config={**spec(llama.perturbed, k=2), "draft_cores": [0]})
