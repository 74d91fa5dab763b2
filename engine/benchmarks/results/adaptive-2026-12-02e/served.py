"""A served-like closed loop, in-process (diagnostic): C requests in flight, N in all, a new one as soon as one
ends (as `specserve bench sweep` drives a server), configurations interleaved. Per run: throughput and the steps
by kind (plain, speculative, exploration; "noplan": no policy), their seconds and the policy's own time; with
VERBOSE=1 every speculative step and, where the policy chose chains, its predicted rate against plain decode's.

usage (repository root): CONFIGS="none=none;ad=adaptive;k2=k2" [T=0.8] [TARGET=dir DRAFT=dir] [VERBOSE=1]
    python served.py C N OUTPUT_TOKENS REPEATS
"""

import collections
import os
import random
import statistics
import sys
import time

import torch

from engine.llm import LLM
from scheduler.adaptive import AdaptivePolicy
from scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
C, NREQ, OUT, REPS = (int(x) for x in sys.argv[1:5])
T = float(os.environ.get("T", "0.8"))
VERBOSE = bool(os.environ.get("VERBOSE"))
target = os.environ.get("TARGET", "runs/random-pair/target")
draft = os.environ.get("DRAFT", "runs/random-pair/draft")
cfgs: dict[str, dict | None] = {}
for item in os.environ["CONFIGS"].split(";"):
    name, spec = item.split("=", 1)
    if spec == "none":
        cfgs[name] = None
    else:
        fixed = spec.startswith("k")
        cfgs[name] = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(spec[1:]) if fixed else 8,
                      "adaptive": not fixed}

if VERBOSE:  # the chains' predicted rate against plain decode's, where the policy chose chains
    _best_chains = AdaptivePolicy.best_chains

    def best_chains(self, rs):
        best = _best_chains(self, rs)
        if any(best.shapes):
            plain = self.price(rs, [()] * len(rs))
            print(f"     chains {best.rate:.1f} tok/s ({best.tokens:.1f} in {best.seconds:.3f} s, "
                  f"{sum(map(len, best.shapes))} nodes), plain {plain.rate:.1f} ({plain.tokens:.1f} in "
                  f"{plain.seconds:.3f} s), catch-up {sum(r.catchup for r in rs)} tokens, batch {len(rs)}")
        return best

    AdaptivePolicy.best_chains = best_chains

llms = {n: LLM(target, s if s else "none", max_num_seqs=max(C, 64), num_kv_tokens=max(C, 64) * (OUT + 128))
        for n, s in cfgs.items()}
rng = random.Random(0)
prompts = [[rng.randrange(3, 1000) for _ in range(32)] for _ in range(NREQ)]
res = collections.defaultdict(list)
for rep in range(REPS):
    names = list(cfgs)
    for n in names[rep % len(names):] + names[: rep % len(names)]:
        eng = llms[n].engine
        pol = eng.scheduler.policy
        trace: list[tuple[int, int, int, bool]] = []  # (batch, candidates, speculating requests, exploration)
        plan_s: list[float] = []
        if isinstance(pol, AdaptivePolicy):
            def plan(reqs, prefill=False, _p=pol, _plan=AdaptivePolicy.plan, trace=trace, plan_s=plan_s):
                e0, t0 = _p.explored_steps, time.perf_counter()
                shapes = _plan(_p, reqs, prefill)
                plan_s.append(time.perf_counter() - t0)
                trace.append((len(reqs), sum(map(len, shapes)), sum(1 for s in shapes if s), _p.explored_steps > e0))
                return shapes
            pol.plan = plan
        sent = done = tok = 0
        steps: list[tuple[float, tuple | None]] = []
        t0 = time.perf_counter()
        while done < NREQ:
            while sent - done < C and sent < NREQ:
                eng.add_request(f"r{rep}-{sent}", prompts[sent],
                                SamplingParams(max_tokens=OUT, temperature=T, ignore_eos=True))
                sent += 1
            before, s0, tok0 = len(trace), time.perf_counter(), tok
            for d in eng.step():
                tok += len(d.new_token_ids)
                done += d.finished
            steps.append((time.perf_counter() - s0, trace[before] if len(trace) > before else None, tok - tok0))
        elapsed = time.perf_counter() - t0
        if isinstance(pol, AdaptivePolicy):
            del pol.plan
        res[n].append(tok / elapsed)
        kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for s, tr, _ in steps:
            k = "noplan" if tr is None else "explore" if tr[3] else "spec" if tr[1] else "plain"
            kinds[k][0] += 1
            kinds[k][1] += s
        print(f"rep {rep} {n:>5}: {tok / elapsed:6.1f} tok/s {elapsed:6.1f} s, {len(steps)} steps: "
              + " ".join(f"{k} {v[0]} ({v[1]:.1f} s)" for k, v in sorted(kinds.items()))
              + f"; policy {sum(plan_s):.2f} s", flush=True)
        if VERBOSE:
            for i, (s, tr, emitted) in enumerate(steps):
                if tr and tr[1]:
                    print(f"   step {i}: {s * 1000:.0f} ms, {emitted} tokens, batch {tr[0]}, {tr[1]} candidates on "
                          f"{tr[2]} requests"
                          + (", exploration" if tr[3] else ""))
print("medians", {n: round(statistics.median(v), 1) for n, v in res.items()})
base = list(cfgs)[0]
for n in list(cfgs)[1:]:
    ratios = [a / b for a, b in zip(res[n], res[base], strict=True)]
    print(f"{n}/{base}: per repeat {[round(r, 3) for r in ratios]}, "
          f"ratio of medians {statistics.median(res[n]) / statistics.median(res[base]):.3f}")
for llm in llms.values():
    llm.shutdown()
