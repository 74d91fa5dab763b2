"""Engines in lockstep at a fixed concurrency, continuous batching: each engine keeps CONC requests in flight,
admitting the next prompt as soon as one finishes (as a server under CONC closed-loop clients does), until
N requests have run; each engine is timed by its own steps only. Unlike ``kmax.py`` (groups of BATCH that all
finish before the next starts), the batch stays full but for the last requests, so a policy is not charged for a
group's tail that continuous batching does not have. N requests of MAX_TOKENS tokens (64; 48 on the random pair)
on the built-in pair's prompts (cycled), or random 32-token prompts with PAIR=random.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/flow.py T CONC N ENGINES

ENGINES: ``nospec``, ``k<N>`` (a fixed chain of N), ``a<N>`` (adaptive, K_max N); ``_<n>`` a second one alike.
``l<N>``: adaptive with the draft never sent prompt chunks (a request's first speculative round feeds its whole
prefix), as before 14695c7 (meaningful at 14695c7-c2e84da, where the draft was sent prompt chunks; reverted
after). ``c<N>``: adaptive with a batch size's verify sizes not moved together (``CostModel.verify_comove`` 0;
meaningful at 8321f60 only, reverted next). ``p<N>``: adaptive with every attention in one padded call (its steps run
with ``workers.input_batch.GROUP_CALL_PAIRS`` 1e12: rounds of different depths not grouped, as before b690b6b).
Prints tokens per second per quarter of the run (by requests finished) and over the run, and the ratios.
"""

import dataclasses
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from engine.benchmarks.compare import load_prompts
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from workers import input_batch

torch.set_num_threads(1)
temp, conc, n_req, names = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
if os.environ.get("PAIR") == "random":
    d, max_tokens = os.path.abspath("runs/random-pair"), 48
    prompts = load_prompts(None, None, 32000, 64, 400)
else:
    d, max_tokens = os.path.abspath("engine/default_models"), 64
    prompts = load_prompts(f"{d}/prompts.jsonl", AutoTokenizer.from_pretrained(f"{d}/target"), 10**9, 64, 400)


def make(name: str) -> LLM:
    depth = int(name[1:].split("_")[0]) if name != "nospec" else 0
    spec = None if name == "nospec" else {"method": "draft_model", "model": f"{d}/draft",
                                          "num_speculative_tokens": depth, "adaptive": name[0] in "alcp"}
    llm = LLM(f"{d}/target", spec, max_num_seqs=max(64, conc), num_kv_tokens=max(64, conc) * 600)
    if name[0] == "l":
        dr = llm.engine.drafter
        dr.propose = lambda batch, gone, orig=dr.propose: orig(dataclasses.replace(batch, prefills=[]), gone)
    if name[0] == "c":
        pol = llm.engine.scheduler.policy
        pol.cost.verify_comove = pol.sampled_cost.verify_comove = 0.0
    return llm


engines = {n: make(n).engine for n in names}
grouped = input_batch.GROUP_CALL_PAIRS
params = SamplingParams(max_tokens=max_tokens, temperature=temp, ignore_eos=True)
admitted = dict.fromkeys(names, 0)
quarters = {n: [[0, 0.0] for _ in range(4)] for n in names}  # [tokens, seconds] by the quarter finished so far
outs: dict[str, dict[str, list[int]]] = {n: {} for n in names}
turn = 0
while any(len(outs[n]) < n_req for n in names):
    for n in names[turn % len(names):] + names[:turn % len(names)]:
        eng = engines[n]
        while admitted[n] < n_req and len(eng.scheduler.running) + len(eng.scheduler.waiting) < conc:
            eng.add_request(str(admitted[n]), prompts[admitted[n] % len(prompts)], params)
            admitted[n] += 1
        if not eng.has_unfinished:
            continue
        e0 = eng.stats.num_emitted + eng.stats.num_plain_rounds
        input_batch.GROUP_CALL_PAIRS = 10**12 if n[0] == "p" else grouped  # in-process workers: per step
        t0 = time.perf_counter()
        finished = eng.step_finished()
        q = quarters[n][min(3, 4 * len(outs[n]) // n_req)]
        q[1] += time.perf_counter() - t0
        q[0] += eng.stats.num_emitted + eng.stats.num_plain_rounds - e0
        outs[n].update((o.request_id, o.token_ids) for o in finished)
    turn += 1
if temp == 0:  # greedy: every engine's tokens are the target's
    first = outs[names[0]]
    assert all(outs[n] == first for n in names), "greedy outputs differ"
for n in names:
    print(f"{n}: " + ", ".join(f"q{i} {t / max(s, 1e-9):.1f}" for i, (t, s) in enumerate(quarters[n])) + " tok/s")
total = {n: sum(t for t, _ in quarters[n]) / sum(s for _, s in quarters[n]) for n in names}
print("over the run (tok/s): " + ", ".join(f"{n} {t:.1f}" for n, t in total.items()))
for ref in [max((n for n in names if n.startswith("k")), key=lambda n: total[n], default=None),
            "nospec" if "nospec" in names else None]:
    if ref:
        print(f"vs {ref}: " + ", ".join(f"{n} {t / total[ref]:.3f}" for n, t in total.items()))
chosen = {n: engines[n].stats.as_dict().get("mean_chosen_depth") for n in names if n[0] in "alcp"}
print("mean chosen depth: " + ", ".join(f"{n} {v}" for n, v in chosen.items()))
for n in names:  # where each engine's step time went (schedule_s holds the policy's planning)
    s = engines[n].stats.as_dict()
    pol = engines[n].scheduler.policy
    print(f"{n} times: {engines[n].times.as_dict()}; plain rounds {s.get('plain_decode_rounds')}, explored steps "
          f"{getattr(pol, 'explored_steps', None)}, depths {s.get('chosen_depths')}")
