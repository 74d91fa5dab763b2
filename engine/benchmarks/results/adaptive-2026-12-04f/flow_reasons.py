"""Why the adaptive policy decodes plainly at a fixed concurrency (continuous batching, as ``flow.py``): the
adaptive engine (K_max 8) and a fixed chain of K stepping in lockstep; for each adaptive step, which branch of
``_plan_free`` chose it (``unknown``, ``clear``, ``search``, ``kept``, ``X`` an exploration: see
``../adaptive-2026-12-04c/reasons.py``), the predicted rates of plain decode, the best speculating chains and the
chain of K for everyone, and the real step. Ends with tokens and seconds by branch.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/flow_reasons.py T CONC N K
"""

import collections
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.cost_model import Curve
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
temp, conc, n_req, k = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)


def make(depth: int, adaptive: bool):
    spec = {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": depth, "adaptive": adaptive}
    return LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine


engines = {"adaptive": make(8, True), f"k{k}": make(k, False)}
pol = engines["adaptive"].scheduler.policy
plan_free = pol._plan_free
info: dict = {}


def traced(rs, fixed, prefill=False):
    nseqs = len(rs) + len(pol._pinned)
    key = (Curve.bucket(nseqs), pol._cost is pol.sampled_cost)
    left = pol._clear[key].steps if key in pol._clear else 0
    lead = pol._clear.get(key)
    why = "unknown" if not pol._cost.knows_batch_size(nseqs) else None
    e0 = pol.explored_steps
    out = plan_free(rs, fixed, prefill)
    if why is None and lead is not None and pol._clear.get(key) is lead and lead.steps < left:
        why = "clear"  # the held lead's steps went down: this step kept it
    plain = pol.price(rs, [()] * len(rs))
    searched = pol.best_chains(rs)
    if why is None:
        why = "search" if [tuple(s) for s in searched.shapes] == [tuple(s) for s in out] else "kept"
    if pol.explored_steps > e0:
        why = "X"
    kk = pol.price(rs, [(1,) * min(k, r.cap) for r in rs])
    info.update(why=why, plain=plain.rate, best_spec=pol.spec_rate, kk=kk.rate, n=len(rs), prefill=prefill,
                depth=sum(len(s) for s in out) / max(1, len(out)), lags=sorted(r.lag for r in rs)[-3:])
    return out


pol._plan_free = traced
params = SamplingParams(max_tokens=64, temperature=temp, ignore_eos=True)
admitted = dict.fromkeys(engines, 0)
done = dict.fromkeys(engines, 0)
by_why = collections.defaultdict(lambda: [0, 0.0, 0])
totals = {m: [0, 0.0] for m in engines}
phase = {m: {False: [0, 0.0, 0], True: [0, 0.0, 0]} for m in engines}  # with prompts to prefill or not
turn = 0
names = list(engines)
while any(done[m] < n_req for m in names):
    for m in names[turn % 2:] + names[:turn % 2]:
        eng = engines[m]
        while admitted[m] < n_req and len(eng.scheduler.running) + len(eng.scheduler.waiting) < conc:
            eng.add_request(str(admitted[m]), prompts[admitted[m] % len(prompts)], params)
            admitted[m] += 1
        if not eng.has_unfinished:
            continue
        info.clear()
        pre = bool(eng.scheduler.waiting) or any(r.num_cached_target < len(r.prompt_token_ids)
                                                 for r in eng.scheduler.running)
        e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
        t0 = time.perf_counter()
        done[m] += len(eng.step_finished())
        ms = (time.perf_counter() - t0) * 1000
        em = eng.stats.num_emitted + eng.stats.num_plain_rounds - e0
        totals[m][0] += em
        totals[m][1] += ms
        phase[m][pre][0] += em
        phase[m][pre][1] += ms
        phase[m][pre][2] += 1
        if m == "adaptive" and "why" in info:
            i = info
            w = by_why[i["why"] + (" prefill" if i["prefill"] else "")]
            w[0] += em
            w[1] += ms
            w[2] += 1
            print(f"n{i['n']:2d} {i['why']:<7} depth {i['depth']:.2f} plain {i['plain']:.3f} best_spec "
                  f"{i['best_spec']:.3f} k{k} {i['kk']:.3f} real {em} tok {ms:.1f} ms ({em / ms:.3f})"
                  f"{' prefill' if i['prefill'] else ''} lags {[round(x, 1) for x in i['lags']]}", flush=True)
        elif m != "adaptive":
            print(f"   [{m}] {em} tok {ms:.1f} ms ({em / ms:.3f})", flush=True)
    turn += 1
for w, (t, s, n) in sorted(by_why.items()):
    print(f"{w}: {n} steps, {t} tok, {s / 1000:.2f} s ({t / s * 1000:.1f} tok/s)")
for m in engines:
    print(m + ": " + "; ".join(f"{'prefill' if p else 'decode'} {n} steps {t} tok {s / 1000:.2f} s "
                               f"({t / max(s, 1e-9) * 1000:.1f} tok/s)" for p, (t, s, n) in phase[m].items()))
print("tok/s: " + ", ".join(f"{m} {t / s * 1000:.1f}" for m, (t, s) in totals.items()))
