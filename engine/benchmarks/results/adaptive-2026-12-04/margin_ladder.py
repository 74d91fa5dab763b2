"""The adaptive policy's ``spec_margin`` on a batch-size ladder: no speculation and the adaptive policy (K_max 8)
with each margin, stepping in lockstep in one process (``engine_lockstep``: each engine's row gets its own steps'
wall time only, so the machine's drift falls on all alike), unseeded, 48 tokens per request, on the larger
random pair. Prints per-repeat ratios to no speculation. From the repository root, with the pair made as in
../adaptive-2026-12-03d/commands.sh (``make_random_pair('runs/random-pair', 1024, 12, 32000)``):

    SPECSERVE_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1 \\
        python engine/benchmarks/results/adaptive-2026-12-04/margin_ladder.py 0.05,0.08 3 [BATCHES]

A policy ``M/curve-age`` runs margin M with the exploration of fb4a7b9's parent: a size never measured at the
batch size is as old as the batch size's curve (not counted from when speculation started or stopped).
``BATCHES``: the rungs to run (default 8,16,32,64).
"""

import sys
import time

import torch

from engine.benchmarks.compare_report import Row
from engine.benchmarks.engine_runs import engine_lockstep, engine_run
from engine.llm import LLM

torch.set_num_threads(1)
policies = sys.argv[1].split(",")
repeats = int(sys.argv[2])
RUNGS = [(8, 16), (16, 32), (32, 64), (64, 64)]  # (batch, prompts)
if len(sys.argv) > 3:
    RUNGS = [r for r in RUNGS if str(r[0]) in sys.argv[3].split(",")]
TOKENS, PAIR = 48, "runs/random-pair"
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(1, 32000, (32,), generator=gen).tolist() for _ in range(64)]
kv = 64 * (32 + TOKENS + 64)
spec = {"method": "draft_model", "model": f"{PAIR}/draft", "num_speculative_tokens": 8, "adaptive": True}
llms = {"nospec": LLM(f"{PAIR}/target", "none", max_num_seqs=64, num_kv_tokens=kv)}


def age_from_curve(policy):
    """The exploration as before fb4a7b9: the steps since speculation started or stopped never shorten an age."""
    explore = policy._exploration

    def old(rs, chosen, fixed, prefill=False):
        policy._speculating, policy._mode_steps = any(chosen.shapes), 10**9
        return explore(rs, chosen, fixed, prefill)
    policy._exploration = old


for name in policies:
    llm = LLM(f"{PAIR}/target", spec, max_num_seqs=64, num_kv_tokens=kv)
    policy = llm.engine.scheduler.policy
    policy.spec_margin = float(name.split("/")[0])
    if name.endswith("/curve-age"):
        age_from_curve(policy)
    llms[f"margin {name}"] = llm
t_start = time.perf_counter()
try:
    for temp in (0.8, 0.0):
        for batch, n in RUNGS:
            groups = [prompts[i: i + batch] for i in range(0, n, batch)]
            for llm in llms.values():  # warm-up, untimed: the first use of a batch shape allocates
                engine_run(llm, groups[:1], 2, temp, None)
            rows = {m: Row(m, temp, batch) for m in llms}
            explored = {m: llm.engine.scheduler.policy.explored_steps for m, llm in llms.items() if m != "nospec"}
            for _ in range(repeats):
                outs = engine_lockstep(llms, groups, TOKENS, temp, rows, seeded=False)
                if temp == 0.0:  # greedy: speculation never changes a token
                    assert all(o == outs["nospec"] for o in outs.values()), "greedy outputs differ"
            base = rows["nospec"]
            tokens = sum(len(g) for g in groups) * TOKENS
            line = [f"T={temp} batch {batch:>2} ({n} prompts): nospec {tokens / min(base.seconds):6.1f} tok/s best"]
            for m, row in rows.items():
                if m == "nospec":
                    continue
                ratios = ",".join(f"{b / s:.2f}" for s, b in zip(row.seconds, base.seconds, strict=True))
                ex = llms[m].engine.scheduler.policy.explored_steps - explored[m]
                line.append(f"{m}: {ratios} (total {sum(base.seconds) / sum(row.seconds):.3f}, depth "
                            f"{row.mean_chosen_depth or 0:.2f}, explored {ex} steps)")
            print(" | ".join(line), f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
finally:
    for llm in llms.values():
        llm.shutdown()
