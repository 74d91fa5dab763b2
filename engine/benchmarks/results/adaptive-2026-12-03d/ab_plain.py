"""A/B at step granularity: nospec vs the adaptive default (forced plain, and free), batch 64, round-robin steps.
The prototype of ``bench compare --lockstep``; from the repository root:

    python engine/benchmarks/results/adaptive-2026-12-03d/ab_plain.py 0.8 60
"""

import random
import statistics
import sys
import time

import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
T = float(sys.argv[1]) if len(sys.argv) > 1 else 0.8
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
draft = "runs/random-pair/draft"
ad = {"method": "draft_model", "model": draft, "num_speculative_tokens": 8, "adaptive": True}
cfgs = {"nospec": "none", "plain": ad, "free": ad}
rng = random.Random(0)
prompts = [[rng.randrange(3, 1000) for _ in range(32)] for _ in range(64)]
engs = {}
for name, spec in cfgs.items():
    llm = LLM("runs/random-pair/target", spec, max_num_seqs=64, num_kv_tokens=64 * (40 + steps + 20))
    eng = llm.engine
    if name == "plain":
        eng.scheduler.policy.forced = ()
    for i, p in enumerate(prompts):
        eng.add_request(f"{name}{i}", p, SamplingParams(max_tokens=steps + 10, temperature=T, ignore_eos=True))
    engs[name] = (llm, eng)
for _, eng in engs.values():
    for _ in range(4):
        eng.step()
cpu = {n: [] for n in engs}
wall = {n: [] for n in engs}
toks = {n: 0 for n in engs}
for s in range(steps):
    order = list(engs) if s % 2 == 0 else list(engs)[::-1]
    for n in order:
        eng = engs[n][1]
        c0, w0 = time.thread_time(), time.perf_counter()
        out = eng.step()
        cpu[n].append(time.thread_time() - c0)
        wall[n].append(time.perf_counter() - w0)
        toks[n] += sum(len(o.new_token_ids) for o in out)
base = statistics.median(cpu["nospec"])
for n in engs:
    print(f"{n:7s} cpu median {statistics.median(cpu[n])*1000:7.1f} ms  mean {statistics.mean(cpu[n])*1000:7.1f}  "
          f"wall median {statistics.median(wall[n])*1000:7.1f}  tokens {toks[n]}  "
          f"tok/cpu-s {toks[n]/sum(cpu[n]):6.1f}  paired median ratio "
          f"{statistics.median(a/b for a,b in zip(cpu[n], cpu['nospec'], strict=True)):.3f}")
for _, (llm, _) in engs.items():
    llm.shutdown()
