"""Step by step, one engine on the built-in pair: 64 prompts in groups of BATCH (as ``bench compare`` runs them),
each step's emitted tokens, wall ms and its split; for the adaptive policy also its chosen plan ("X": an
exploration), the plan's predicted tokens and ms, and the predicted (tokens, ms) of every request at depth 0, 2,
4 and 6. From the repository root:

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04b/diag/steps.py MODE T BATCH REPEATS

MODE: ``adaptive`` (K_max 8, the default policy), ``forced<N>`` (the same engine with every round at depth N, e.g.
``forced4``) or ``k4`` (a fixed chain of 4, ``"adaptive": false``). Each repeat ends with its totals.
"""

import collections
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.benchmarks.engine_runs import _params, add_group
from engine.llm import LLM

torch.set_num_threads(1)
mode, temp, batch, repeats = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
adaptive = mode != "k4"
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8 if adaptive else 4,
        "adaptive": adaptive}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
plan: dict = {}
if adaptive:
    pol = eng.scheduler.policy
    if mode.startswith("forced"):
        pol.forced = (1,) * int(mode.removeprefix("forced"))
    plan_free = pol._plan_free

    def traced(rs, fixed, prefill=False):
        e0 = pol.explored_steps
        out = plan_free(rs, fixed, prefill)
        p = pol.price(rs, out)
        alt = {k: pol.price(rs, [(1,) * min(k, r.cap) for r in rs]) for k in (0, 2, 4, 6)}
        depths = collections.Counter(len(s) for s in out)
        text = ",".join(f"{k}:{v}" for k, v in sorted(depths.items()))
        plan.update(text=("X" if pol.explored_steps > e0 else "") + text,
                    tok=p.tokens, ms=p.seconds * 1000,
                    alt={k: (round(a.tokens), round(a.seconds * 1000)) for k, a in alt.items()})
        return out

    pol._plan_free = traced
split = ("schedule_s", "draft_wall_s", "verify_wall_s", "commit_s")
for rep in range(repeats):
    total_tok, total_ms = 0, 0.0
    for g in range(0, 64, batch):
        group = prompts[g:g + batch]
        add_group(eng, group, _params(group, g, 64, temp, False), f"{rep}-{g}-")
        while eng.has_unfinished:
            plan.clear()
            before = dict(eng.times.__dict__)
            e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
            t0 = time.perf_counter()
            eng.step_finished()
            ms = (time.perf_counter() - t0) * 1000
            em = eng.stats.num_emitted + eng.stats.num_plain_rounds - e0
            total_tok, total_ms = total_tok + em, total_ms + ms
            parts = " ".join(f"{k[:-2]}={1000 * (eng.times.__dict__[k] - before[k]):.0f}" for k in split)
            line = f"r{rep} g{g} real {em:4d} tok {ms:7.1f} ms [{parts}]"
            if "text" in plan:
                line += (f" | {plan['text']:<24} pred {plan['tok']:6.1f} tok {plan['ms']:6.1f} ms"
                         f" | all at depth k: {plan['alt']}")
            print(line)
    print(f"repeat {rep}: {total_tok} tokens in {total_ms:.0f} ms ({total_tok / total_ms:.3f} tok/ms)", flush=True)
