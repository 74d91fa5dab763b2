"""Milliseconds of ``AdaptivePolicy.plan`` per step at batch 64 (K_max 8), on the cost curves a c64 greedy
server measured (c64-greedy-profile.json, the larger random pair), each request's draft accepting 0.8: with the
search skipped behind a wide lead of plain decode (the default) and searching every step (``clear_steps=0``).

    python engine/benchmarks/results/adaptive-2026-12-03b/plan_bench.py    # from the repository root
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from scheduler.cost_model import cost_model_from_dict  # noqa: E402
from tests.test_adaptive_policy import policy, requests, teach  # noqa: E402

profile = json.loads((Path(__file__).parent / "c64-greedy-profile.json").read_text())
STEPS = 200
for repeat in range(3):
    for label, kw in (("skip behind a wide lead", {}), ("search every step", {"clear_steps": 0})):
        p = policy(cost_model_from_dict(profile["greedy"]), **kw)
        reqs = requests(64)
        for r in reqs:
            teach(p, r, 0.8, seed=r.seq_id)
        t = time.perf_counter()
        for _ in range(STEPS):
            out = p.plan(reqs)
        ms = (time.perf_counter() - t) / STEPS * 1e3
        print(f"repeat {repeat + 1} {label:<24} {ms:6.3f} ms a step, speculating requests {sum(map(bool, out))}")
