"""Does a step's verify cost follow its tokens, or its deepest round (one attention call pads every round's queries
to the longest)? Built-in pair, one group of BATCH prompts (at most 150 tokens, 340 generated); after their prefill,
steps in turn at the plans below (every round at 4; half at 2, half at 6: as many tokens, deeper queries; one at 7,
the rest at 4; ...); the verify and draft wall ms of each as the engine measured them, beside the adaptive
policy's price of the same shapes (its curves learn from these steps).

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04c/ragged.py BATCH TURNS
"""

import os
import statistics
import sys

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.benchmarks.engine_runs import _params, add_group
from engine.llm import LLM

torch.set_num_threads(1)
batch, turns = int(sys.argv[1]), int(sys.argv[2])
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, batch, 150)
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
pol = eng.scheduler.policy
plans = {
    "all 4": lambda n: [(1,) * 4] * n,
    "half 2, half 6": lambda n: [(1,) * (2 if i % 2 else 6) for i in range(n)],
    "one 7, rest 4": lambda n: [(1,) * 7] + [(1,) * 4] * (n - 1),
    "all 5": lambda n: [(1,) * 5] * n,
    "all 6": lambda n: [(1,) * 6] * n,
    "4, 5 and 6": lambda n: [(1,) * (4 + i % 3) for i in range(n)],
    "plain": lambda n: [()] * n,
}
current = [next(iter(plans))]
predicted: dict[str, list[tuple[float, float, float]]] = {k: [] for k in plans}


def plan(reqs, prefill=False):
    shapes = [s[: pol.base.cap(r)] for r, s in zip(reqs, plans[current[0]](len(reqs)), strict=True)]
    # The policy's price of these shapes (its views of the requests, as its own ``plan`` makes them).
    priors = {g: pol.acceptance.engine_rates(g, pol.base.tree.depth) for g in (False, True)}
    views = [pol._view(r, priors[r.params.greedy]) for r in reqs]
    pol._cost, pol._pinned = pol._regime_cost(views), []
    verify, forwards, fseqs = 0, [], []
    for v, shape in zip(views, shapes, strict=True):
        _, n, fw = pol._round(v, shape)
        verify += n
        forwards += [0.0] * (len(fw) - len(forwards))
        fseqs += [0] * (len(fw) - len(fseqs))
        for f, x in enumerate(fw):
            forwards[f] += x
            fseqs[f] += 1
    c = pol._cost
    predicted[current[0]].append((c.verify_seconds(verify, len(reqs)) * 1000,
                                  c.draft_seconds(forwards, fseqs) * 1000, c.state(len(reqs)) * 1000))
    return shapes


pol.plan = plan
add_group(eng, prompts, _params(prompts, 0, 340, 0.0, False))
while eng.scheduler.waiting or any(r.is_prefilling for r in eng.scheduler.running):
    eng.step_finished()
times: dict[str, list[tuple[float, float]]] = {k: [] for k in plans}
for k in predicted:
    predicted[k].clear()
for _ in range(turns):
    for name in plans:
        current[0] = name
        t = eng.times
        v0, d0 = t.verify_wall_s, t.draft_wall_s
        eng.step_finished()
        times[name].append(((t.verify_wall_s - v0) * 1000, (t.draft_wall_s - d0) * 1000))
print("plan             real verify / draft ms    the policy's price: verify / draft / controller ms (medians)")
for name, xs in times.items():
    pr = predicted[name]
    print(f"{name:<16} {statistics.median(v for v, _ in xs):6.1f} / {statistics.median(d for _, d in xs):6.1f}"
          f"          {statistics.median(p[0] for p in pr):6.1f} / {statistics.median(p[1] for p in pr):6.1f} / "
          f"{statistics.median(p[2] for p in pr):4.1f}  ({len(xs)} steps)")
