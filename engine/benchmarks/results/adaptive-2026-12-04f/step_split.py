"""The random pair at concurrency 32 (greedy, 128 requests x 48 tokens, lockstep with no speculation): each
engine's steps split by whether prompt chunks shared them and whether the adaptive engine speculated in them (its
draft was called), with their wall, verify and draft seconds.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/step_split.py
"""

import collections
import os
import time

import torch

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
d = os.path.abspath("runs/random-pair")
prompts = load_prompts(None, None, 32000, 64, 400)
conc, n_req = 32, 128


def make(adaptive: bool):
    spec = ({"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True}
            if adaptive else None)
    return LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine


engines = {"a8": make(True), "nospec": make(False)}
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
admitted, done = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0)
split = {m: collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0]) for m in engines}  # [steps, wall, verify, draft]
names = list(engines)
turn = 0
while any(done[m] < n_req for m in names):
    for m in names[turn % 2:] + names[:turn % 2]:
        eng = engines[m]
        while admitted[m] < n_req and len(eng.scheduler.running) + len(eng.scheduler.waiting) < conc:
            eng.add_request(str(admitted[m]), prompts[admitted[m] % len(prompts)], params)
            admitted[m] += 1
        if not eng.has_unfinished:
            continue
        prefill = bool(eng.scheduler.waiting) or any(r.num_cached_target < len(r.prompt_token_ids)
                                                     for r in eng.scheduler.running)
        v0, d0 = eng.times.verify_wall_s, eng.times.draft_wall_s
        t0 = time.perf_counter()
        done[m] += len(eng.step_finished())
        wall = time.perf_counter() - t0
        kind = ("prefill " if prefill else "decode ") + ("spec" if eng.times.draft_wall_s - d0 > 1e-4 else "plain")
        s = split[m][kind]
        s[0] += 1
        s[1] += wall
        s[2] += eng.times.verify_wall_s - v0
        s[3] += eng.times.draft_wall_s - d0
    turn += 1
for m in names:
    for kind, (n, wall, verify, draft) in sorted(split[m].items()):
        print(f"{m:6s} {kind:14s} {n:4d} steps wall {wall:7.2f} s (mean {wall / n * 1e3:7.1f} ms) verify {verify:7.2f} "
              f"draft {draft:5.2f}")
