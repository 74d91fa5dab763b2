"""The plan search's time with its per-search memo of size prices against without (cdb36a7): one adaptive engine
(K_max 8) on the built-in pair, 64 prompts x 64 tokens in groups of 32, greedy; at each step ``best_chains`` runs
twice on the same state, with the memo and with every cap pricing its sizes afresh, and both plans must agree.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04c/memo_timing.py
"""

import os
import time

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.benchmarks.engine_runs import _params, add_group
from engine.llm import LLM

torch.set_num_threads(1)
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
pol = eng.scheduler.policy


class NoStore(dict):
    """A memo that keeps nothing: every size priced each time it comes up."""

    def __setitem__(self, key, value) -> None:
        pass


best_prefix, best_chains = pol._best_prefix, pol.best_chains
seconds = {"memo": 0.0, "none": 0.0}
calls = agree = 0


def timed(rs):
    global calls, agree
    t0 = time.perf_counter()
    a = best_chains(rs)
    seconds["memo"] += time.perf_counter() - t0
    pol._best_prefix = lambda rs_, cut, base, memo: best_prefix(rs_, cut, base, NoStore())
    t0 = time.perf_counter()
    b = best_chains(rs)
    seconds["none"] += time.perf_counter() - t0
    pol._best_prefix = best_prefix
    calls += 1
    agree += (a.shapes, a.seconds) == (b.shapes, b.seconds)
    return a


pol.best_chains = timed
for g in range(0, 64, 32):
    group = prompts[g:g + 32]
    add_group(eng, group, _params(group, g, 64, 0.0, False), f"{g}-")
    while eng.has_unfinished:
        eng.step_finished()
print(f"{calls} searches ({agree} plans identical): {1000 * seconds['memo'] / calls:.2f} ms each with the memo, "
      f"{1000 * seconds['none'] / calls:.2f} ms without")
