"""Engines in lockstep (built-in pair, 64 prompts x 64 tokens in groups of BATCH, REPEATS times): each engine's
tokens and seconds of its own steps by phase. The first repeat (cold curves) apart; after it, steps with requests
waiting (prefill), with the whole group decoding (full), and with part of it finished (tail). ENGINES:
``a<N>`` the adaptive policy with K_max N, ``k<N>`` a fixed chain of N.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04d/phases.py BATCH T REPEATS ENGINES
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
batch, temp, repeats, names = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)


def make(name: str):
    spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": int(name[1:]),
            "adaptive": name[0] == "a"}
    return LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine


engines = {n: make(n) for n in names}
acc = {n: collections.defaultdict(lambda: [0, 0.0, 0]) for n in names}  # phase -> [tokens, seconds, steps]
for rep in range(repeats):
    for g in range(0, 64, batch):
        group = prompts[g:g + batch]
        for eng in engines.values():
            add_group(eng, group, _params(group, g, 64, temp, False), f"{rep}-{g}-")
        turn = 0
        while any(e.has_unfinished for e in engines.values()):
            for n in names[turn % len(names):] + names[:turn % len(names)]:
                eng = engines[n]
                if not eng.has_unfinished:
                    continue
                running = len(eng.scheduler.running)
                if rep == 0:
                    phase = "rep0"
                elif eng.scheduler.waiting or not running:
                    phase = "prefill"
                else:
                    phase = "full" if running == batch else "tail"
                e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
                t0 = time.perf_counter()
                eng.step_finished()
                a = acc[n][phase]
                a[0] += eng.stats.num_emitted + eng.stats.num_plain_rounds - e0
                a[1] += time.perf_counter() - t0
                a[2] += 1
            turn += 1
    print(f"after repeat {rep}", flush=True)
for phase in ("rep0", "prefill", "full", "tail"):
    print(f"{phase}: " + "; ".join(
        f"{n} {acc[n][phase][0]} tok {acc[n][phase][1]:.2f}s {acc[n][phase][2]} steps "
        f"({acc[n][phase][0] / max(acc[n][phase][1], 1e-9):.0f} tok/s)" for n in names))
after = {n: [sum(v[i] for k, v in acc[n].items() if k != "rep0") for i in (0, 1)] for n in names}
print("repeats 1+: " + "; ".join(f"{n} {t / s:.1f} tok/s" for n, (t, s) in after.items()))
