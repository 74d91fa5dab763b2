"""Controller overhead per round: msgpack frames over zmq vs plain Ray actor calls, side by side in one run.

``RayExecutor.echo`` sends a realistic TargetStep to the target's ranks, which decode it and answer a
TargetStepOutput of the same shape without running the model: what is left is the per-round cost of the
transport (encode, send, worker decode, reply encode, receive, decode). Batch B of VerifySeqs, each with a
5-node candidate tree, all ints: a sampled request's q goes from the draft to the verifier directly and is
named here by its tree id only (benchmarks/round_bytes.py measures the bytes of a whole round).
The two transports of one TP size run at the same time and take turns in blocks, so a machine whose load
changes during the run treats them alike.

    python -m benchmarks.transport [--rounds 500] [--json runs/transport.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.tp_step import make_random_checkpoint, percentile
from engine.core.config import ParallelConfig
from engine.execution import codec
from workers.messages import SamplingSpec, TargetStep, VerifySeq
from workers.worker_config import WorkerConfig

TREE_PARENTS = [-1, -1, 0, 1, 2]  # 5 nodes: two children of the root, then a chain under each
TRANSPORTS = ("zmq", "ray")


def make_step(batch: int, sampled: bool, vocab: int) -> TargetStep:

    spec = SamplingSpec(temperature=0.8 if sampled else 0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=12345)
    seqs = []
    for i in range(batch):
        seqs.append(VerifySeq(seq_id=i, block_table=list(range(8 * i, 8 * i + 8)), base_len=117, token_ids=[42],
                              tree_tokens=[11 + i, 12, 13, 14, 15], tree_parents=TREE_PARENTS, sampling=spec,
                              tree_id=i if sampled else -1))
    return TargetStep(seqs=seqs)


def measure(executors: dict[str, Any], msg: TargetStep, rounds: int, warmup: int, block: int) -> dict[str, list]:
    """Per-round µs for each transport, taking turns every ``block`` rounds."""
    times: dict[str, list[float]] = {t: [] for t in executors}
    for ex in executors.values():
        for _ in range(warmup):
            ex.echo("target", msg)
    done = 0
    while done < rounds:
        n = min(block, rounds - done)
        for t, ex in executors.items():
            for _ in range(n):
                start = time.perf_counter()
                ex.echo("target", msg)
                times[t].append((time.perf_counter() - start) * 1e6)
        done += n
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--block", type=int, default=50, help="rounds per turn before switching transport")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tp", default="1,2", help="target tensor-parallel sizes")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    tp_sizes = [int(t) for t in args.tp.split(",")]

    import ray

    from engine.execution.ray_executor import RayExecutor

    tmp = tempfile.TemporaryDirectory(prefix="specserve-transport-")
    # The echo never runs the model; a small one keeps start-up short.
    target = make_random_checkpoint(os.path.join(tmp.name, "target"), hidden=64, layers=1, vocab=args.vocab,
                                    heads=4, kv_heads=4, intermediate=128)
    wcfg = WorkerConfig(target, num_blocks=8 * max(batches) + 1, block_size=16)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    rows = []
    for tp in tp_sizes:
        executors = {t: RayExecutor(ParallelConfig(tensor_parallel_size=tp, backend="ray", transport=t), wcfg, None)
                     for t in TRANSPORTS}
        try:
            for b in batches:
                for sampled in (False, True):
                    msg = make_step(b, sampled, args.vocab)
                    times = measure(executors, msg, args.rounds, args.warmup, args.block)
                    row = {"tp": tp, "batch": b, "law": "sampled" if sampled else "greedy",
                           "message_bytes": len(codec.encode(msg))}
                    for t in TRANSPORTS:
                        row[t] = {"median_us": statistics.median(times[t]), "p90_us": percentile(times[t], 0.9)}
                    row["ray_over_zmq"] = row["ray"]["median_us"] / row["zmq"]["median_us"]
                    rows.append(row)
        finally:
            for ex in executors.values():
                ex.shutdown()

    load = os.getloadavg()
    print(f"\nper-round controller overhead (echo, no model), {args.rounds} rounds after {args.warmup} warm-up, "
          f"V={args.vocab}, 5-node trees; {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f}")
    print(f"{'TP':>2} {'batch':>5} {'law':>7} {'bytes':>9} | {'zmq med µs':>10} {'p90':>8} | "
          f"{'ray med µs':>10} {'p90':>8} | ray/zmq")
    for r in rows:
        print(f"{r['tp']:>2} {r['batch']:>5} {r['law']:>7} {r['message_bytes']:>9} | "
              f"{r['zmq']['median_us']:>10.0f} {r['zmq']['p90_us']:>8.0f} | "
              f"{r['ray']['median_us']:>10.0f} {r['ray']['p90_us']:>8.0f} | {r['ray_over_zmq']:>6.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "warmup": args.warmup, "vocab": args.vocab, "cpus": os.cpu_count(),
                       "load_average": load, "rows": rows}, f, indent=2)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
