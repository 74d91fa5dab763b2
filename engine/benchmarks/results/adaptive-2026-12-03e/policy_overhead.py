"""The adaptive policy's controller time at saturation: one engine (adaptive default, K_max 8) on the larger random
pair, B requests decoding, N steps after 5 warm ones; prints the engine's step-time breakdown (schedule_s is the
policy's plan plus the scheduler). From the repository root, with the pair made as
in ../adaptive-2026-12-03d/commands.sh (``make_random_pair('runs/random-pair', 1024, 12, 32000)``):

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-03e/policy_overhead.py 32 0.8 30
"""

import random
import sys
import time

import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
B, T, steps = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
spec = {"method": "draft_model", "model": "runs/random-pair/draft", "num_speculative_tokens": 8, "adaptive": True}
llm = LLM("runs/random-pair/target", spec, max_num_seqs=B, num_kv_tokens=B * 200)
eng = llm.engine
rng = random.Random(0)
for i in range(B):
    eng.add_request(str(i), [rng.randrange(3, 1000) for _ in range(32)],
                    SamplingParams(max_tokens=150, temperature=T, ignore_eos=True))
for _ in range(5):
    eng.step()
eng.times.__init__()  # the timed steps only: the warm ones hold the prefill
t0 = time.perf_counter()
for _ in range(steps):
    eng.step()
wall = time.perf_counter() - t0
times = eng.times.as_dict()
print(f"batch {B} T={T}: {steps} steps in {wall:.2f} s ({wall / steps * 1000:.0f} ms a step); "
      f"schedule {times['schedule_s'] / times['steps'] * 1000:.1f} ms a step; {times}")
llm.shutdown()
