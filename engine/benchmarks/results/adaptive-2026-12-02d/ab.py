"""Interleaved in-process A/B of engine configurations on the same prompts (diagnostic).

usage (repository root): CONFIGS="none=none;ad=adaptive;f0=adaptive:forced=0;k4=k4" [T=0.8] [TARGET=dir DRAFT=dir]
    [P=prompts] python ab.py MAX_NUM_SEQS OUTPUT_TOKENS REPEATS
adaptive:forced=N pins every round to a chain of N (0: plain decode) after start-up; kN: fixed chain of N.
"""

import os
import random
import statistics
import sys
import time

import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)

B, N, REPS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
T = float(os.environ.get("T", "0.8"))
target = os.environ.get("TARGET", "engine/default_models/target")
draft = os.environ.get("DRAFT", "engine/default_models/draft")
P = int(os.environ.get("P", str(max(B, 8))))
cfgs = {}
for item in os.environ["CONFIGS"].split(";"):
    name, spec = item.split("=", 1)
    forced = None
    if spec.startswith("k"):
        s = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(spec[1:]), "adaptive": False}
    elif spec == "none":
        s = None
    else:
        parts = spec.split(":")
        s = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": int(os.environ.get("KMAX", "8")),
            "adaptive": True,
        }
        for p in parts[1:]:
            k, v = p.split("=")
            if k == "forced":
                forced = (1,) * int(v) if int(v) else ()
            elif k == "tree":
                s["tree_branching"] = [int(x) for x in v.split(",")]
                s["num_speculative_tokens"] = len(s["tree_branching"])
            else:
                s[k] = float(v)
    cfgs[name] = (s, forced)
rng = random.Random(0)
prompts = [[rng.randrange(3, 1000) for _ in range(32)] for _ in range(P)]
llms = {}
for name, (s, forced) in cfgs.items():
    llms[name] = LLM(target, s if s else "none", max_num_seqs=B, num_kv_tokens=max(B, P) * (N + 128))
    if forced is not None:
        llms[name].engine.scheduler.policy.forced = forced
res = {n: [] for n in cfgs}
names = list(cfgs)
for rep in range(REPS):
    order = names[rep % len(names) :] + names[: rep % len(names)]
    for n in order:
        eng = llms[n].engine
        eng.stats.__init__()
        eng.times.__init__()
        t0 = time.perf_counter()
        outs = llms[n].generate(
            prompts, [SamplingParams(max_tokens=N, temperature=T, ignore_eos=True) for _ in prompts]
        )
        el = time.perf_counter() - t0
        tok = sum(len(o.token_ids) for o in outs)
        res[n].append(tok / el)
        cd = eng.stats.as_dict().get("chosen_depths") if eng.config.speculative else None
        print(f"rep {rep} {n:>6}: {tok / el:7.1f} tok/s  {cd}", flush=True)
print("medians:", {n: round(statistics.median(v), 1) for n, v in res.items()})
base = names[0]
for n in names[1:]:
    rs = [a / b for a, b in zip(res[n], res[base], strict=True)]
    print(
        f"{n}/{base}: per-rep {[round(r, 2) for r in rs]} median {statistics.median(rs):.3f}  "
        f"ratio of medians {statistics.median(res[n]) / statistics.median(res[base]):.3f}"
    )
for n in names:
    llms[n].shutdown()
