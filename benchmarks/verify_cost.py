"""Where a target verify step's time goes, sampled vs greedy: the target forward vs everything after it
(transforms, residuals, draws, tree walk), per round, for no speculation / a chain / a tree, on the same prompts.

Wraps the in-process target worker's ``step``, ``runner.forward`` and ``_verify`` and the draft worker's ``step``
with timers (uni executor only), so the numbers are the workers' own, without messaging. Each is reported as CPU
time of the thread that ran it (``time.thread_time``: what a loaded machine distorts least) per round;
tokens/s is wall time. Modes run interleaved within each repeat; medians are printed.

    python -m benchmarks.verify_cost --batches 1,8 --temperatures 0,0.8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.config import default_model_dirs
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams


def _timed(fn: Callable, acc: dict, key: str) -> Callable:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] = acc.get(key, 0.0) + time.thread_time() - t0
    return wrapper


def _instrument(llm: LLM) -> dict:
    acc: dict[str, float] = {}
    target = llm.engine.executor.target  # LocalExecutor only
    target.runner.forward = _timed(target.runner.forward, acc, "forward_s")
    target._verify = _timed(target._verify, acc, "verify_s")
    target.step = _timed(target.step, acc, "step_s")
    draft = llm.engine.executor.draft
    if draft is not None:
        draft.step = _timed(draft.step, acc, "draft_s")
    return acc


def run_once(llm: LLM, acc: dict, prompts: list[list[int]], batch: int, temp: float, max_tokens: int) -> dict:
    acc.clear()
    eng = llm.engine
    eng.reset_stats()
    params = [SamplingParams(max_tokens=max_tokens, temperature=temp, ignore_eos=True, seed=1000 + j)
              for j in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:batch], params)
    wall = time.perf_counter() - t0
    steps = max(1, eng.times.steps)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / wall, "steps": steps, "step_ms": 1e3 * acc.get("step_s", 0.0) / steps,
            "forward_ms": 1e3 * acc.get("forward_s", 0.0) / steps, "verify_ms": 1e3 * acc.get("verify_s", 0.0) / steps,
            "draft_ms": 1e3 * acc.get("draft_s", 0.0) / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--modes", default="nospec,chain4,tree221")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = map(str, default_model_dirs())
    chain = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
    specs = {"nospec": "none", "chain4": chain,
             "tree221": {**chain, "num_speculative_tokens": 3, "tree_branching": [2, 2, 1]}}
    modes = [m for m in args.modes.split(",") if m]
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = [[1, 200 + i, 300 + 7 * i, 45, 99 + i, 12, 7 * i + 3] for i in range(max(batches))]
    llms = {m: LLM(target, specs[m], dtype="float32", device="cpu", max_num_seqs=max(batches),
                   num_kv_tokens=max(batches) * (args.max_tokens + 64)) for m in modes}
    accs = {m: _instrument(llm) for m, llm in llms.items()}
    rows: dict[tuple, list[dict]] = {}
    try:
        for m, llm in llms.items():  # warm-up
            run_once(llm, accs[m], prompts, 1, 0.8, 8)
        for _ in range(args.repeats):
            for temp in temps:
                for b in batches:
                    for m, llm in llms.items():  # interleaved
                        rows.setdefault((m, temp, b), []).append(
                            run_once(llm, accs[m], prompts, b, temp, args.max_tokens))
    finally:
        for llm in llms.values():
            llm.shutdown()
    print(f"{'mode':<8} {'T':>4} {'b':>3} {'tok/s':>8} {'step ms':>8} {'fwd ms':>7} {'verify ms':>9} "
          f"{'draft ms':>8}  (medians of {args.repeats}; ms: CPU per round)")
    table = []
    for (m, temp, b), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        table.append({"mode": m, "temperature": temp, "batch": b, **med})
        print(f"{m:<8} {temp:>4} {b:>3} {med['tok_s']:>8.1f} {med['step_ms']:>8.2f} {med['forward_ms']:>7.2f} "
              f"{med['verify_ms']:>9.2f} {med['draft_ms']:>8.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
