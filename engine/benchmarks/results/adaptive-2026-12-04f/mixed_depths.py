"""The target's verify time at batch 32 (built-in pair, prompts cut to 120 tokens, contexts growing to ~450 over the
run) for rounds of uniform and of mixed depths at about equal tokens, with the rounds grouped by query count
(``workers.input_batch.GROUP_CALL_PAIRS`` as set) and in one padded call (1e12), the plans and the two layouts
taking turns step by step; the policy's plan is replaced by the given depths. Prints the median and the minimum
verify time of each (the contexts grow as the run goes, so the minimum is the early, comparable one).

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/mixed_depths.py REPEATS
"""

import os
import sys

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from workers import input_batch

torch.set_num_threads(1)
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True,
        "adaptive_warmup_s": 0}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
pol = eng.scheduler.policy
plans = {"32 x 4": [4] * 32, "8 + 31 x 4": [8] + [4] * 31, "2/6": [2, 6] * 16, "3/5": [3, 5] * 16,
         "1/7": [1, 7] * 16, "32 x 5": [5] * 32}
layouts = {"grouped": input_batch.GROUP_CALL_PAIRS, "one call": 10**12}
now: dict = {"plan": None}


def plan(reqs, prefill=False):
    depths = plans[now["plan"]] if now["plan"] else [0] * len(reqs)
    return [(1,) * min(depths[i % len(depths)], pol.base.cap(r)) for i, r in enumerate(reqs)]


pol.plan = plan
params = SamplingParams(max_tokens=380, temperature=0.0, ignore_eos=True)
for i in range(32):
    eng.add_request(str(i), prompts[i % len(prompts)][:120], params)
while any(r.is_prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
    eng.step()
runs = [(p, lay) for p in plans for lay in layouts]
times: dict = {r: [] for r in runs}
for rep in range(int(sys.argv[1])):
    for p, lay in runs[rep % len(runs):] + runs[:rep % len(runs)]:
        now["plan"] = p
        input_batch.GROUP_CALL_PAIRS = layouts[lay]
        v0 = eng.times.verify_wall_s
        eng.step()
        times[p, lay].append(eng.times.verify_wall_s - v0)
for (p, lay), xs in times.items():
    xs.sort()
    print(f"{p:11s} {lay:8s} verify tokens {sum(t + 1 for t in plans[p])}: median {xs[len(xs) // 2] * 1e3:6.1f} ms, "
          f"min {xs[0] * 1e3:6.1f} ms")
