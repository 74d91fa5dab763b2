"""Bytes on the wire and time per round of a sampled batch, at a real vocabulary size.

Two measurements on one random checkpoint pair (vocabulary 49,152 by default, tiny layers: the model's own
time is small, what is left is the cost of moving messages):

- ``bytes``: the engine runs in this process; every message of a round is encoded with the wire codec (msgpack,
  exactly what the Ray executor sends) and counted by kind: controller -> draft, draft -> controller,
  controller -> target (once per target rank), target -> controller, and draft -> target (the laws, which
  only exist as a separate frame where the draft hands them to the verifier directly).
- ``ray``: the engine runs its workers in Ray actors (zmq transport) and the median step time is taken.

Only public engine entry points are used, so the same command can measure an older tree (PYTHONPATH).

    python -m benchmarks.round_bytes [--vocab 49152] [--batch 32] [--k 8] [--modes bytes,ray]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

SETTINGS = {  # name -> sampling parameters
    "T1": {"temperature": 1.0},
    "T0.8-topk50": {"temperature": 0.8, "top_k": 50},
    "T0.8-topk1000": {"temperature": 0.8, "top_k": 1000},
}


def _pair(root: str, vocab: int) -> tuple[str, str]:
    from benchmarks.tp_step import make_random_checkpoint

    shape = dict(hidden=64, layers=1, vocab=vocab, heads=4, kv_heads=4, intermediate=128)
    return (make_random_checkpoint(os.path.join(root, "target"), seed=0, **shape),
            make_random_checkpoint(os.path.join(root, "draft"), seed=1, **shape))


def _requests(batch: int, max_tokens: int, sampling: dict):
    from engine import SamplingParams

    prompts = [[1 + (7 * i + j) % 500 for j in range(8)] for i in range(batch)]
    params = [SamplingParams(max_tokens=max_tokens, seed=100 + i, ignore_eos=True, **sampling) for i in range(batch)]
    return prompts, params


def measure_bytes(target: str, draft: str, args, sampling: dict) -> dict:
    """Mean bytes per decode round by message kind (engine in this process, messages encoded to count them)."""
    from engine import LLM, codec

    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": args.k, "adaptive": False},
              max_num_seqs=args.batch)
    ex = llm.engine.executor
    sizes: dict[str, int] = defaultdict(int)
    rounds = [0]
    sub_d, wait_d, sub_t, wait_t = ex.submit_draft, ex.wait_draft, ex.submit_target, ex.wait_target

    def submit_draft(msg):
        sizes["controller->draft"] += len(codec.encode(msg))
        return sub_d(msg)

    def wait_draft():
        out = wait_d()
        sizes["draft->controller"] += len(codec.encode(out))
        return out

    def submit_target(msg):
        rounds[0] += bool(msg.seqs)
        sizes["controller->target (per rank)"] += len(codec.encode(msg))
        return sub_t(msg)

    def wait_target():
        out = wait_t()
        sizes["target->controller"] += len(codec.encode(out))
        return out

    ex.submit_draft, ex.wait_draft = submit_draft, wait_draft
    ex.submit_target, ex.wait_target = submit_target, wait_target
    sink = getattr(ex.draft, "law_sink", None)
    if sink is not None:  # the laws' own channel (trees whose q goes to the verifier directly)
        from workers import law_channel

        def law_sink(laws):  # what the Ray executor's socket carries: the packed laws
            sizes["draft->target (laws)"] += len(codec.encode([law_channel.pack_laws(d) for d in laws]))
            return sink(laws)

        ex.draft.law_sink = law_sink
    prompts, params = _requests(args.batch, args.max_tokens, sampling)
    llm.generate(prompts, params)
    llm.shutdown()
    per_round = {k: v / max(1, rounds[0]) for k, v in sizes.items()}
    per_round["total"] = sum(per_round.values())
    return {"rounds": rounds[0], "bytes_per_round": per_round}


def measure_ray(target: str, draft: str, args, sampling: dict) -> dict:
    """Median and mean wall time of a decode step with the workers in Ray actors."""
    from engine import LLM

    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": args.k, "adaptive": False},
              max_num_seqs=args.batch, distributed_executor_backend="ray")
    try:
        eng = llm.engine
        prompts, params = _requests(args.batch, args.max_tokens, sampling)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(str(i), p, sp)
        steps = []
        while eng.has_unfinished:
            start = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - start)
        decode = steps[2:] or steps  # the first steps prefill
        return {"steps": len(steps), "median_step_ms": 1e3 * statistics.median(decode),
                "mean_step_ms": 1e3 * statistics.fmean(decode)}
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8, help="chain length: candidate nodes per request per round")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--modes", default="bytes,ray")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("SPECSERVE_WORKER_THREADS", "1"))))
    rows = []
    with tempfile.TemporaryDirectory(prefix="specserve-round-bytes-") as root:
        target, draft = _pair(root, args.vocab)
        for name in args.settings.split(","):
            row: dict = {"setting": name, **SETTINGS[name]}
            if "bytes" in args.modes:
                row.update(measure_bytes(target, draft, args, SETTINGS[name]))
            if "ray" in args.modes:
                row.update(measure_ray(target, draft, args, SETTINGS[name]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "batch": args.batch, "k": args.k, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
