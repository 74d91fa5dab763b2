"""Every round (seq_id, depth, accepted) of a fixed chain of 8, in order: what the acceptance estimators are scored on.

    OMP_NUM_THREADS=1 [T=0.8] [TARGET=smollm2] python engine/benchmarks/results/adaptive-2026-12-02b/record_rounds.py \
        CONCURRENCY NUM_REQUESTS OUT.json

Requests: the built-in pair's prompts in turn, 128 tokens each (NTOK), ignore_eos, a closed loop at CONCURRENCY.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

PAIR = "engine/default_models"


def main() -> None:
    torch.set_num_threads(1)
    concurrency, total, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    target = os.environ.get("TARGET")  # a packaged target (smollm2) brings its own draft
    spec = {"num_speculative_tokens": 8, "adaptive": False}
    if target is None:
        target, spec["model"] = PAIR + "/target", PAIR + "/draft"
    llm = LLM(target, spec, dtype="float32")
    eng = llm.engine
    rows: list[tuple[int, int, int]] = []
    policy = eng.scheduler.policy

    def observe_round(req, branching, num_accepted) -> None:
        rows.append((req.seq_id, len(branching), num_accepted))

    object.__setattr__(policy, "observe_round", observe_round)  # the fixed policy is a frozen dataclass
    with open(PAIR + "/prompts.jsonl") as f:
        prompts = [llm.tokenizer.encode(json.loads(line)["prompt"]) for line in f if line.strip()]
    sp = SamplingParams(temperature=float(os.environ.get("T", 0)), max_tokens=int(os.environ.get("NTOK", 128)),
                        ignore_eos=True)
    added = done = 0
    while done < total:
        while added - done < concurrency and added < total:
            eng.add_request(f"{time.time()}-{added}", prompts[added % len(prompts)], sp)
            added += 1
        done += len(eng.step_finished())
    with open(out, "w") as f:
        json.dump(rows, f)
    print(len(rows), "rounds")
    llm.shutdown()


if __name__ == "__main__":
    main()
