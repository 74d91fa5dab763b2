"""A fixed chain of 4 (k4) and the adaptive policy forced to the same chain of 4 (f4), side by side in one process.

f4 runs the adaptive machinery (its start-up profiling unless WU=0 sets ``adaptive_warmup_s``, planning, cost
learning) with the depths of k4, so any gap is overhead. Six requests one after another (batch 1), 4 repetitions
in alternating order; per step: wall and each part of ``engine.times`` (ms). SWAP=1 builds f4 first.

    OMP_NUM_THREADS=1 [SWAP=1] [WU=0] python engine/benchmarks/results/adaptive-2026-12-02b/forced_vs_fixed.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

PAIR = "engine/default_models"


def build(adaptive: bool) -> LLM:
    spec = {"method": "draft_model", "model": PAIR + "/draft", "num_speculative_tokens": 4, "adaptive": adaptive}
    if adaptive and "WU" in os.environ:
        spec["adaptive_warmup_s"] = float(os.environ["WU"])
    llm = LLM(PAIR + "/target", spec, dtype="float32")
    if adaptive:
        llm.engine.scheduler.policy.forced = (1, 1, 1, 1)
    return llm


def main() -> None:
    torch.set_num_threads(1)
    names = ["f4", "k4"] if os.environ.get("SWAP") else ["k4", "f4"]
    cfgs = [(n, build(n == "f4")) for n in names]
    tok = cfgs[0][1].tokenizer
    with open(PAIR + "/prompts.jsonl") as f:
        prompts = [tok.encode(json.loads(line)["prompt"]) for line in f if line.strip()]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    acc: dict[str, dict[str, float]] = {n: {} for n, _ in cfgs}
    for rep in range(4):
        for name, llm in cfgs if rep % 2 == 0 else cfgs[::-1]:
            eng = llm.engine
            before = dataclasses.asdict(eng.times)
            t0 = time.perf_counter()
            steps = 0
            for i in range(6):
                eng.add_request(f"{name}{rep}-{i}", prompts[i], sp)
                while not eng.step_finished():
                    steps += 1
                steps += 1
            a = acc[name]
            a["wall"] = a.get("wall", 0.0) + time.perf_counter() - t0
            a["steps"] = a.get("steps", 0.0) + steps
            for k, v in dataclasses.asdict(eng.times).items():
                if isinstance(v, float):
                    a[k] = a.get(k, 0.0) + v - before.get(k, 0.0)
    for name, a in acc.items():
        s = a.pop("steps")
        print(name, "steps", int(s), " ".join(f"{k}={1e3 * v / s:.2f}" for k, v in a.items()))
    for _, llm in cfgs:
        llm.shutdown()


if __name__ == "__main__":
    main()
