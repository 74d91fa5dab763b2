"""Why the adaptive policy decodes plainly where a fixed chain pays: no speculation, the adaptive policy (K_max 8)
and fixed chains stepping in lockstep (``engine_lockstep``'s order) on the built-in pair, 64 prompts x 64 tokens in
groups of BATCH. For each adaptive step: which branch of ``_plan_free`` chose its plan (``unknown``: the batch size
has fewer than two verify sizes; ``clear``: a plain-decode lead held; ``search``: the search; ``kept``: the previous
plan kept by hysteresis; ``X``: an exploration), the predicted rates of plain decode and of the best speculating
chains, and the real step. Ends with a table by branch and each engine's tokens per second of its own steps.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04c/reasons.py T BATCH REPEATS [KS] [-v]
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
temp, batch, repeats = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ks = [int(k) for k in sys.argv[4].split(",")] if len(sys.argv) > 4 and sys.argv[4] != "-v" else [4]
verbose = "-v" in sys.argv
d = os.path.abspath("engine/default_models")
prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)


def make(k, adaptive):
    spec = None if k == 0 else {"method": "draft_model", "model": f"{d}/draft", "num_speculative_tokens": k,
                                "adaptive": adaptive}
    return LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600).engine


engines = {"nospec": make(0, False), "adaptive": make(8, True), **{f"k{k}": make(k, False) for k in ks}}
pol = engines["adaptive"].scheduler.policy
plan_free = pol._plan_free
info: dict = {}


def traced(rs, fixed, prefill=False):
    from scheduler.cost_model import Curve
    nseqs = len(rs) + len(pol._pinned)
    key = (Curve.bucket(nseqs), pol._cost is pol.sampled_cost)
    if not pol._cost.knows_batch_size(nseqs):
        why = "unknown"
    elif pol._clear.get(key, 0) > 0 and not pol._pinned:
        why = "clear"
    else:
        why = None
    e0 = pol.explored_steps
    out = plan_free(rs, fixed, prefill)
    plain = pol.price(rs, [()] * len(rs))
    searched = pol.best_chains(rs)  # re-run: its spec_rate is the best speculating chains' predicted rate
    if why is None:
        why = "search" if [tuple(s) for s in searched.shapes] == [tuple(s) for s in out] else "kept"
    if pol.explored_steps > e0:
        why = "X"
    chosen = pol.price(rs, out)
    k4 = pol.price(rs, [(1,) * min(4, r.cap) for r in rs])
    info.update(why=why, spec=any(out), plain=plain.rate, best_spec=pol.spec_rate, k4=k4.rate,
                pred_ms=chosen.seconds * 1000, pred_tok=chosen.tokens, plain_ms=plain.seconds * 1000,
                depth=sum(len(s) for s in out) / len(out), prefill=prefill, n=len(rs))
    return out


pol._plan_free = traced
observe_step = pol.observe_step


def observed(sample):
    # The curves' price of what the step really ran (before they learn from it): verify, draft call, controller.
    c = pol.sampled_cost if sample.sampled and pol.sampled_cost.ready else pol.cost
    if not sample.prefill_tokens and not sample.draft_prefill:
        info["parts"] = (
            (c.verify_seconds(sample.verify_tokens, sample.num_seqs), sample.verify_s),
            (c.draft_seconds(sample.draft_forward_tokens, sample.draft_forward_seqs), sample.draft_s),
            (c.state(sample.num_seqs), sample.state_s),
        )
        info["sizes"] = (sample.verify_tokens, list(sample.draft_forward_tokens))
    observe_step(sample)


pol.observe_step = observed
totals = {m: [0, 0.0] for m in engines}
rows = []
PARTS = {"verify": ("verify_wall_s",), "draft": ("draft_wall_s", "collect_s"), "schedule": ("schedule_s",),
         "commit": ("commit_s",)}
split = {m: collections.Counter() for m in engines}
per_group = collections.defaultdict(lambda: {m: [0, 0.0] for m in engines})
for rep in range(repeats):
    for g in range(0, 64, batch):
        group = prompts[g:g + batch]
        for eng in engines.values():
            add_group(eng, group, _params(group, g, 64, temp, False), f"{rep}-{g}-")
        order, turn = list(engines), 0
        while any(e.has_unfinished for e in engines.values()):
            for m in order[turn % len(order):] + order[:turn % len(order)]:
                eng = engines[m]
                if not eng.has_unfinished:
                    continue
                info.clear()
                before = dict(eng.times.__dict__)
                n_before = len(eng.scheduler.running)
                e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
                t0 = time.perf_counter()
                eng.step_finished()
                ms = (time.perf_counter() - t0) * 1000
                em = eng.stats.num_emitted + eng.stats.num_plain_rounds - e0
                totals[m][0] += em
                totals[m][1] += ms
                per_group[(rep, g)][m][0] += em
                per_group[(rep, g)][m][1] += ms
                t = eng.times.__dict__
                for part, keys in PARTS.items():
                    split[m][part] += sum(t[k] - before[k] for k in keys) * 1000
                split[m]["steps"] += 1
                split[m]["tokens"] += em
                if m != "adaptive" and verbose:
                    print(f"  [{m}] n{n_before} {em} tok {ms:.1f} ms", flush=True)
                if m == "adaptive" and "why" in info:
                    row = dict(info, real_ms=ms, real_tok=em, rep=rep, g=g)
                    rows.append(row)
                    if verbose:
                        print(f"r{rep} g{g} n{row['n']:2d} {row['why']:<7} spec={int(row['spec'])}"
                              f" depth {row['depth']:.2f}"
                              f" plain {row['plain']:.3f} best_spec {row['best_spec']:.3f} k4 {row['k4']:.3f}"
                              f" (ratio {row['best_spec'] / row['plain']:.3f})"
                              f" pred {row['pred_tok']:.1f} tok {row['pred_ms']:.1f} ms real {em} tok {ms:.1f} ms"
                              f"{' prefill' if row['prefill'] else ''}", flush=True)
                        if "parts" in row:
                            parts = (1000 * x for pr in row["parts"] for x in pr)
                            print("    pred/real ms verify {:.1f}/{:.1f} draft {:.1f}/{:.1f} state {:.1f}/{:.1f}"
                                  .format(*parts), row["sizes"], flush=True)
            turn += 1
    print(f"after repeat {rep}: " + ", ".join(f"{m} {t / s * 1000:.1f}" for m, (t, s) in totals.items()) + " tok/s",
          flush=True)

print("\nadaptive steps by branch (full batch only: n == BATCH, no prefill):")
print(f"{'branch':<8}{'spec':>5}{'steps':>7}{'real ms':>9}{'pred ms':>9}{'real/pred':>10}{'best_spec/plain':>16}"
      f"{'k4/plain':>10}{'real tok/ms':>12}")
groups = collections.defaultdict(list)
for r in rows:
    if r["n"] == batch and not r["prefill"]:
        groups[(r["why"], r["spec"])].append(r)
for (why, spec), rs in sorted(groups.items()):
    n = len(rs)
    real = sum(r["real_ms"] for r in rs) / n
    pred = sum(r["pred_ms"] for r in rs) / n
    ratio = sum(r["best_spec"] / r["plain"] for r in rs) / n
    k4 = sum(r["k4"] / r["plain"] for r in rs) / n
    tpm = sum(r["real_tok"] for r in rs) / sum(r["real_ms"] for r in rs)
    print(f"{why:<8}{int(spec):>5}{n:>7}{real:>9.1f}{pred:>9.1f}{real / pred:>10.3f}{ratio:>16.3f}{k4:>10.3f}"
          f"{tpm:>12.3f}")
print("\nthe curves' price of the sizes really run, by part (full batch, no prefill): predicted / real ms")
for spec in (0, 1):
    rs = [r for r in rows if r["n"] == batch and not r["prefill"] and "parts" in r and r["spec"] == spec]
    if rs:
        parts = [[sum(1000 * r["parts"][i][k] for r in rs) / len(rs) for k in (0, 1)] for i in range(3)]
        print(f"spec={spec} ({len(rs)} steps): " + ", ".join(
            f"{name} {p:.1f}/{q:.1f}" for name, (p, q) in zip(("verify", "draft", "state"), parts, strict=True)))
print("\ntok/s by group: " + "; ".join(f"r{rep} g{g} " + " ".join(f"{m} {t / s * 1000:.0f}" for m, (t, s) in v.items())
                                     for (rep, g), v in per_group.items()))
print("\neach engine's ms by part over the run (and per step):")
for m, c in split.items():
    print(f"{m:<9} {c['tokens']} tokens, {c['steps']} steps: " + ", ".join(
        f"{p} {c[p]:.0f} ({c[p] / c['steps']:.1f})" for p in PARTS))
print("\ntok/s of each engine's own steps: " + ", ".join(f"{m} {t / s * 1000:.1f}" for m, (t, s) in totals.items()))
