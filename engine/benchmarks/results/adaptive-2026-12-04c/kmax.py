"""The adaptive policy with K_max 8 and with lower K_max beside fixed chains, in lockstep (``engine_lockstep``) on
the built-in pair: 64 prompts x 64 tokens in groups of BATCH, REPEATS times; each engine's tokens per second of its
own steps, per repeat and over all. Does the policy lose to a fixed chain by its deeper choices?

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04c/kmax.py T BATCH REPEATS ENGINES

PAIR=random: the larger random pair in runs/random-pair (hidden 1024, 12 layers, vocab 32k; its draft the
target's first layer) with random 32-token prompts and 48 tokens each, as ``bench compare`` runs it.

ENGINES: comma-separated ``nospec``, ``k<N>`` (fixed chain of N), ``a<N>`` (adaptive, K_max N), ``e<N>`` (the
same with every request planned from the engine-wide rates of its regime: ``request_prior_weight`` 1e9) and
``c<N>`` (the same with a request's own rounds weighed against 32 rounds of the engine's rates: what the default
did on this pair before it planned alike requests from the engine's rates alone). ``m<N>`` / ``h<N>`` /
``f<N>``: the adaptive policy with ``spec_margin`` 0 / 0.025 / 0.05 (how much better than plain decode's
speculation must be predicted; 0.05 the default until 12-04d, so ``a<N>`` in 12-04d's files is ``f<N>``, and
0.025 since). A suffix ``_<n>`` makes a second engine of the same kind (``k4,k4_2``: how far two identical
engines differ in one run, the noise floor).
"""

import os
import sys

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.benchmarks.compare_report import Row
from engine.benchmarks.engine_runs import engine_lockstep
from engine.llm import LLM

torch.set_num_threads(1)
temp, batch, repeats, names = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
if os.environ.get("PAIR") == "random":
    d, max_tokens = os.path.abspath("runs/random-pair"), 48
    prompts = load_prompts(None, None, 32000, 64, 400)
else:
    d, max_tokens = os.path.abspath("engine/default_models"), 64
    prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)
groups = [prompts[g:g + batch] for g in range(0, 64, batch)]


def make(name: str) -> LLM:
    depth = int(name[1:].split("_")[0]) if name != "nospec" else 0
    spec = None if name == "nospec" else {"method": "draft_model", "model": f"{d}/draft",
                                          "num_speculative_tokens": depth, "adaptive": name[0] in "aecmhf"}
    llm = LLM(f"{d}/target", spec, max_num_seqs=64, num_kv_tokens=64 * 600)
    if name[0] == "c":
        llm.engine.scheduler.policy.acceptance.request_prior_weight = 32.0
    if name[0] in "mhf":
        llm.engine.scheduler.policy.spec_margin = {"m": 0.0, "h": 0.025, "f": 0.05}[name[0]]
    if name[0] == "e":
        llm.engine.scheduler.policy.acceptance.request_prior_weight = 1e9
    return llm


llms = {n: make(n) for n in names}
rows = {n: Row(n, temp, batch) for n in names}
outs = None
for rep in range(repeats):
    o = engine_lockstep(llms, groups, max_tokens, temp, rows, seeded=False)
    if temp == 0:  # greedy: every engine's tokens are the target's
        assert all(v == next(iter(o.values())) for v in o.values())
    print(f"repeat {rep}: " + ", ".join(f"{n} {64 * max_tokens / rows[n].seconds[-1]:.1f}" for n in names),
          flush=True)
total = {n: 64 * max_tokens * repeats / sum(rows[n].seconds) for n in names}
print("over all repeats (tok/s): " + ", ".join(f"{n} {t:.1f}" for n, t in total.items()))
ref = max((n for n in names if n.startswith("k")), key=lambda n: total[n], default=None)
if ref:
    print(f"vs the best fixed chain ({ref}): " + ", ".join(f"{n} {t / total[ref]:.3f}" for n, t in total.items()))
if "nospec" in names:
    print("vs no speculation: " + ", ".join(f"{n} {t / total['nospec']:.3f}" for n, t in total.items()))
