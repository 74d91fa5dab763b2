"""The policy's price of each chain depth against what a step at that depth really took, on a warm engine (built-in
pair, greedy): after two groups as the policy runs them, two groups of BATCH requests step at forced depths in turn
(one step each, DEPTHS rotating, so the machine's drift falls on every depth alike). For each full-batch step,
its predicted verify / draft / controller ms and tokens (priced just before it, as the plan search prices) beside
the measured ones; means per depth.

    MT=160 OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04d/forced.py BATCH DEPTHS

MT: tokens per request (default 64; 160 gives ~10 steps a depth at batch 32). DEPTHS: e.g. 0,2,3,4,5,6,8.
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
from scheduler.plan_search import _add

torch.set_num_threads(1)
batch, depths = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
max_tokens = int(os.environ.get("MT", "64"))
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": 8, "adaptive": True}
eng = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine
pol = eng.scheduler.policy


def add(g: int, tag: str, tokens: int) -> None:
    group = prompts[g:g + batch]
    add_group(eng, group, _params(group, g, tokens, 0.0, False), tag)


for g in (0, 32):  # warm: two groups as the policy runs them
    add(g, f"w{g}-", 64)
    while eng.has_unfinished:
        eng.step_finished()

samples: list = []
observe = pol.observe_step
pol.observe_step = lambda s: (samples.append(s), observe(s))
plan = pol.plan
pred: dict[str, float] = {}


def priced_plan(reqs, prefill=False):
    out = plan(reqs, prefill)
    if pol.forced is not None and not prefill:
        priors = {gr: pol.acceptance.engine_rates(gr, pol.base.tree.depth) for gr in (False, True)}
        views = [pol._view(r, priors[r.params.greedy]) for r in reqs]
        verify, forwards, fseqs = 0, [], []
        for v, shape in zip(views, out, strict=True):
            _, vt, fw = pol._round(v, shape)
            verify += vt
            _add(forwards, fw)
            _add(fseqs, [1] * len(fw))
        c = pol._cost
        pred.update(verify=c.verify_seconds(verify, len(views)), draft=c.draft_seconds(forwards, fseqs),
                    state=c.state(len(views)), tokens=pol.price(views, out).tokens)
    return out


pol.plan = priced_plan
rows = collections.defaultdict(list)  # depth -> (pred verify, verify, pred draft, draft, pred state, state,
#                                                 pred tokens, tokens, wall)
for g in (0, 32):
    add(g, f"m{g}-", max_tokens)
    for _ in range(2):  # the prefill and the first round (the draft's catch-up)
        eng.step_finished()
    i = 0
    while eng.has_unfinished:
        depth = depths[i % len(depths)]
        i += 1
        pol.forced = (1,) * depth
        samples.clear()
        pred.clear()
        running = len(eng.scheduler.running)
        e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
        t0 = time.perf_counter()
        eng.step_finished()
        wall = time.perf_counter() - t0
        if running == batch and samples and pred:
            s = samples[-1]
            rows[depth].append((pred["verify"], s.verify_s, pred["draft"], s.draft_s, pred["state"], s.state_s,
                                pred["tokens"], eng.stats.num_emitted + eng.stats.num_plain_rounds - e0, wall))
    pol.forced = None
print(f"batch {batch}, means over full-batch steps: predicted / real ms (verify, draft, controller), tokens; "
      "real and predicted tokens per ms")
for depth in depths:
    r = rows[depth]
    if r:
        m = [sum(x[i] for x in r) / len(r) for i in range(9)]
        ms = [v * 1e3 for v in m[:6]]
        print(f"d{depth} n{len(r):2d} verify {ms[0]:6.1f}/{ms[1]:6.1f} draft {ms[2]:5.1f}/{ms[3]:5.1f} "
              f"state {ms[4]:4.1f}/{ms[5]:4.1f} tokens {m[6]:6.1f}/{m[7]:6.1f} wall {m[8] * 1e3:6.1f} "
              f"real {m[7] / (m[8] * 1e3):.3f} predicted {m[6] / (ms[0] + ms[2] + ms[4]):.3f}")
