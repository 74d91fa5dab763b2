"""The in-process executor runs a draft call on the caller's thread unless a target call overlaps it.

A second thread running torch pays only when it overlaps the target: its OpenMP team keeps spinning after each
call, and with as many threads as cores that slowed the plain steps after it by ~40 % (engine/execution/executor.py).
So sequential drafting (draft, then verify) must never leave the caller's thread, and pipelined drafting (the next
round's draft while this round verifies) must still overlap.
"""

from __future__ import annotations

import threading

from engine import LLM, SamplingParams
from tests.conftest import spec

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _draft_threads(target: str, cfg: dict) -> tuple[set[str], list[list[int]]]:
    llm = LLM(target, speculative_config=cfg)
    ex = llm.engine.executor
    names: set[str] = set()
    step = ex.draft.step

    def recorded(msg):
        names.add(threading.current_thread().name)
        return step(msg)

    ex.draft.step = recorded
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    llm.shutdown()
    return names, [o.token_ids for o in outs]


def test_sequential_drafting_stays_on_the_callers_thread(llama) -> None:
    names, out = _draft_threads(llama.target, spec(llama.perturbed, k=3))
    assert names == {threading.current_thread().name}
    base = LLM(llama.target).generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert out == [o.token_ids for o in base]


def test_pipelined_drafting_still_overlaps_the_target(llama) -> None:
    names, _ = _draft_threads(llama.target, {**spec(llama.perturbed, k=3), "pipeline": True,
                                             "pipeline_switch": False})
    assert any(n.startswith("draft") for n in names)
