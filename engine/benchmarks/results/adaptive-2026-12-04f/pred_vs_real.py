"""Where a step's predicted time goes wrong: the adaptive engine alone at a fixed concurrency (continuous batching,
as ``flow.py``), each decode-only step's parts priced by the cost model as it stood when the step was planned
(target verify, draft call, controller state) beside what the step measured, and the step's wall time around
``step_finished`` (the rest: what no part of the model prices). Averages by kind: plain (K = 0 for everyone) or
speculating.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/pred_vs_real.py T CONC N
"""

import collections
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
temp, conc, n_req = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
pol = eng.scheduler.policy
seen: list = []
observe = pol.observe_step


def traced(s):
    m = pol.sampled_cost if s.sampled else pol.cost
    if not s.prefill_tokens:
        seen.append((m.verify_seconds(s.verify_tokens, s.num_seqs), s.verify_s,
                     m.draft_seconds(s.draft_forward_tokens, s.draft_forward_seqs), s.draft_s,
                     m.state(s.num_seqs), s.state_s, bool(s.draft_forward_tokens), s.num_seqs, s.verify_tokens))
    observe(s)


pol.observe_step = traced
params = SamplingParams(max_tokens=64, temperature=temp, ignore_eos=True)
admitted = done = 0
sums = collections.defaultdict(lambda: [0.0] * 8)
while done < n_req:
    while admitted < n_req and len(eng.scheduler.running) + len(eng.scheduler.waiting) < conc:
        eng.add_request(str(admitted), prompts[admitted % len(prompts)], params)
        admitted += 1
    seen.clear()
    t0 = time.perf_counter()
    done += len(eng.step_finished())
    wall = time.perf_counter() - t0
    if len(seen) == 1 and seen[0][7] >= conc // 2:
        pv, rv, pd, rd, ps, rs, spec_step, n, vt = seen[0]
        kind = "spec" if spec_step else "plain"
        rest = wall - rv - rd - rs
        print(f"{kind:<5} n{n:2d} verify {vt:4d} tok {pv * 1e3:6.1f}/{rv * 1e3:6.1f} ms  draft {pd * 1e3:6.1f}/"
              f"{rd * 1e3:6.1f}  state {ps * 1e3:5.1f}/{rs * 1e3:5.1f}  rest {rest * 1e3:5.1f}  wall {wall * 1e3:6.1f}"
              f"  predicted/real {(pv + pd + ps) / wall:.2f}", flush=True)
        acc = sums[kind]
        for i, v in enumerate((pv, rv, pd, rd, ps, rs, rest, wall)):
            acc[i] += v
        acc.append(1)
for kind, a in sums.items():
    n = len(a) - 8
    print(f"{kind}: {n} steps, mean ms: verify {a[0] / n * 1e3:.1f} predicted / {a[1] / n * 1e3:.1f} real, draft "
          f"{a[2] / n * 1e3:.1f} / {a[3] / n * 1e3:.1f}, state {a[4] / n * 1e3:.1f} / {a[5] / n * 1e3:.1f}, "
          f"unpriced rest {a[6] / n * 1e3:.1f}, wall {a[7] / n * 1e3:.1f}; predicted / wall "
          f"{(a[0] + a[2] + a[4]) / a[7]:.3f}")
