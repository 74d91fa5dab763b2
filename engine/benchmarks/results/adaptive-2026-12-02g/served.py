"""A served-like closed loop, in-process (diagnostic): C requests in flight, N in all, a new one as soon as one
ends (as `specserve bench sweep` drives a server), configurations interleaved. Per run: throughput and the steps
by kind (plain, speculative, exploration; "noplan": no policy), their seconds and the policy's own time; with
VERBOSE=1 every speculative step (and every step over 2 s) and, where the policy chose chains, its predicted rate
against plain decode's; with EXPLDEBUG=1 why each exploration ran (expl_debug.py). Per run also the mean step
time by kind (decode-only at each batch size, plain or speculative; steps with prompt chunks).

Configurations: "none" (no speculation), "adaptive" (K_max 8), "kN" (fixed chain of N); a name starting with "fp"
runs the adaptive configuration with every round forced plain (what speculation costs when it never speculates).

usage (repository root): CONFIGS="none=none;fp=adaptive;ad=adaptive;k2=k2" [T=0.8] [TARGET=dir DRAFT=dir]
    [VERBOSE=1] [EXPLDEBUG=1] python engine/benchmarks/results/adaptive-2026-12-02g/served.py C N OUTPUT_TOKENS REPEATS
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

if os.environ.get("EXPLDEBUG"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import expl_debug  # noqa: F401  (wraps the policy's exploration)

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
for n, llm in llms.items():  # "fp...": speculation configured, every round forced plain (the policy's floor)
    if n.startswith("fp"):
        llm.engine.scheduler.policy.forced = ()
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
        shapes_log: list[tuple[int, int, int]] = []  # per step: (rounds, prefill tokens, tree nodes)
        _sched = eng.scheduler.schedule

        def schedule(*a, _s=_sched, _log=shapes_log, **k):
            b = _s(*a, **k)
            _log.append((len(b.rounds), sum(c.end - c.start for c in b.prefills), sum(map(len, b.shapes))))
            return b
        eng.scheduler.schedule = schedule
        sent = done = tok = 0
        steps: list[tuple[float, tuple | None]] = []
        t0, c0 = time.perf_counter(), time.process_time()
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
        cpu = time.process_time() - c0
        if isinstance(pol, AdaptivePolicy):
            del pol.plan
        del eng.scheduler.schedule
        pure = collections.defaultdict(list)
        for (sec, _, _), (nr, pf, nodes) in zip(steps, shapes_log, strict=False):
            pure[("decode" if not pf else "prefill", nr if not pf else -1, nodes > 0)].append(sec)
        kinds_ms = {k: (len(v), round(1000 * sum(v) / len(v))) for k, v in sorted(pure.items())
                    if len(v) >= 3 or k[0] == "prefill"}
        print("   by kind (kind, batch, speculative): n, mean ms:", kinds_ms, flush=True)
        res[n].append(tok / elapsed)
        kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for s, tr, _ in steps:
            k = "noplan" if tr is None else "explore" if tr[3] else "spec" if tr[1] else "plain"
            kinds[k][0] += 1
            kinds[k][1] += s
        print(f"rep {rep} {n:>5}: {tok / elapsed:6.1f} tok/s {elapsed:6.1f} s, {len(steps)} steps: "
              + " ".join(f"{k} {v[0]} ({v[1]:.1f} s)" for k, v in sorted(kinds.items()))
              + f"; policy {sum(plan_s):.2f} s; {tok / cpu:.1f} tok/cpu-s", flush=True)
        if VERBOSE:
            for i, (s, tr, emitted) in enumerate(steps):
                if (tr and tr[1]) or s > 2.0:
                    print(f"   step {i}: {s * 1000:.0f} ms, {emitted} tokens, "
                          + (f"batch {tr[0]}, {tr[1]} candidates on {tr[2]} requests" if tr else "no plan")
                          + (", exploration" if tr and tr[3] else ""))
print("medians", {n: round(statistics.median(v), 1) for n, v in res.items()})
base = list(cfgs)[0]
for n in list(cfgs)[1:]:
    ratios = [a / b for a, b in zip(res[n], res[base], strict=True)]
    print(f"{n}/{base}: per repeat {[round(r, 3) for r in ratios]}, "
          f"ratio of medians {statistics.median(res[n]) / statistics.median(res[base]):.3f}")
for llm in llms.values():
    llm.shutdown()
