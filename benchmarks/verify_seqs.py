"""Does a verify step cost the same for the same tokens spread over more sequences? (It does not.)

Runs the adaptive engine with its shape forced, so that every decode step forwards the same number of target
tokens as ``seqs`` sequences x ``depth + 1`` tokens (32 x 1 plain, 16 x 2, 8 x 4, 4 x 8 for 32 tokens), the
layouts interleaved within each repeat, and prints the median verify time of those steps: wall (the engine's
target call) and its thread's CPU time (steadier on a shared machine). The adaptive
policy's verify curves are kept per batch size (scheduler/adaptive/costs.py) because of what this shows.

    python -m benchmarks.verify_seqs --tokens 32 --temperature 0.8 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.core.config import default_model_dirs
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="target tokens per decode step (a power of two)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=17, help="tokens per request (> tokens / 8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = default_model_dirs()
    # (sequences, depth): sequences x (depth + 1) == tokens; 32 x 1 (plain), 16 x 2, 8 x 4, 4 x 8 for 32 tokens
    layouts = [(n, args.tokens // n - 1) for n in dict.fromkeys(args.tokens >> i for i in range(4)) if n >= 1]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (24,), generator=gen).tolist() for _ in range(args.tokens)]
    llm = LLM(target, {"method": "draft_model", "model": draft,
                       "num_speculative_tokens": max(1, max(d for _, d in layouts)),
                       "adaptive": True, "adaptive_warmup_s": 0},
              dtype="float32", device="cpu", max_num_seqs=args.tokens,
              num_kv_tokens=args.tokens * (24 + args.max_tokens + 2 * args.tokens + 64))
    engine = llm.engine
    policy = engine.scheduler.policy
    policy.observing = False
    seen: list[tuple[int, float, float]] = []  # (verify tokens, wall s, CPU s) of each target call
    tokens = [0]
    submit_target, wait_target = engine.executor.submit_target, engine.executor.wait_target

    def record_tokens(msg):  # the tokens of the step's target forward (-1: it also prefilled)
        tokens[0] = -1 if msg.prefills else sum(len(s.token_ids) + len(s.tree_tokens) for s in msg.seqs)
        return submit_target(msg)

    def timed_wait():  # the in-process target runs on this thread, inside wait_target
        t0, c0 = time.perf_counter(), time.thread_time()
        out = wait_target()
        seen.append((tokens[0], time.perf_counter() - t0, time.thread_time() - c0))
        return out

    engine.executor.submit_target = record_tokens
    engine.executor.wait_target = timed_wait
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        for rep in range(args.repeats):
            for n, depth in layouts:
                name = f"{n} x {depth + 1}"
                policy.forced = (1,) * depth
                seen.clear()
                llm.generate(prompts[:n], [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                          ignore_eos=True)] * n)
                steps = [(w, c) for t, w, c in seen if t == args.tokens]
                wall.setdefault(name, []).extend(w for w, _ in steps)
                cpu.setdefault(name, []).extend(c for _, c in steps)
                print(f"repeat {rep + 1}: {name:>8}: {len(steps)} steps of {args.tokens} tokens", flush=True)
    finally:
        llm.shutdown()
    print(f"\n{args.tokens} target tokens per step, T={args.temperature}: median target call wall / CPU (ms)")
    for name in wall:
        if not wall[name]:  # --max-tokens too small for a full round of that depth
            continue
        print(f"  {name:>8}: {statistics.median(wall[name]) * 1e3:7.1f} / {statistics.median(cpu[name]) * 1e3:7.1f}"
              f"   ({len(wall[name])} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
