"""Target step time with tensor parallelism 2 vs 1, on CPU (Ray actors, Gloo), side by side in one run.

A random Llama-shaped model (default hidden 512, 4 layers, vocab 4096) is served by a Ray executor with 1 and
then 2 target ranks, plus the in-process worker as a reference. For each decode batch size the script
prefills that many sequences, then times plain decode steps (one new token per sequence, no speculation):
the controller's wall time per ``submit_target`` + ``wait_target``, median and p90 in ms. Each rank runs
SPECSERVE_WORKER_THREADS torch threads (default 1), so TP=2 also uses twice the cores.

    python -m benchmarks.tp_step [--batches 1,8] [--steps 60] [--json runs/tp_step.json]

On CPU, Gloo's collectives (two all-reduces per layer, one for the embedding, the logits' all-gather) cost
more than the halved matmuls save at small batch; the numbers say by how much. On GPUs (NCCL) the trade-off
is different: measure there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from engine.core.config import ParallelConfig
from workers.messages import PrefillSeq, SamplingSpec, TargetStep, VerifySeq
from workers.worker_config import WorkerConfig

GREEDY = SamplingSpec(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
BLOCK = 16


def make_random_checkpoint(path: str, *, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int,
                           intermediate: int, seed: int = 0) -> str:
    """A random Llama checkpoint (float32, logits O(1)); only the shapes matter for timing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _tables(batch: int, tokens: int) -> list[list[int]]:
    per_seq = -(-tokens // BLOCK)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]


class DecodeRun:
    """``batch`` sequences prefilled through ``submit``, then decoded one token per step."""

    def __init__(self, submit: Any, batch: int, prompt_len: int, max_steps: int, first_id: int) -> None:
        self.submit = submit
        self.tables = _tables(batch, prompt_len + max_steps + 1)
        self.ids = list(range(first_id, first_id + batch))
        prompts = [[(7 * i + 3 * j) % 4000 + 3 for j in range(prompt_len)] for i in range(batch)]
        out = submit(TargetStep(prefills=[PrefillSeq(s, t, 0, p, GREEDY)
                                          for s, t, p in zip(self.ids, self.tables, prompts, strict=True)]))
        self.last = [out.first_tokens[s] for s in self.ids]
        self.length = prompt_len
        self.times_ms: list[float] = []

    def step(self, record: bool = True) -> None:
        msg = TargetStep(seqs=[VerifySeq(s, t, self.length, [tok], [], [], GREEDY)
                               for s, t, tok in zip(self.ids, self.tables, self.last, strict=True)])
        start = time.perf_counter()
        out = self.submit(msg)
        elapsed = time.perf_counter() - start
        self.last = [r.tokens[-1] for r in out.results]
        self.length += 1
        if record:
            self.times_ms.append(elapsed * 1e3)

    def finish(self) -> None:
        self.submit(TargetStep(finished=self.ids))


def time_decode(submits: dict[str, Any], batch: int, prompt_len: int, steps: int, warmup: int,
                block: int = 5) -> dict[str, list[float]]:
    """ms per decode step for each way of running the target; they take turns every ``block`` steps, so a
    machine whose load changes during the run treats them alike."""
    runs = {name: DecodeRun(submit, batch, prompt_len, steps + warmup, 1000 * batch)
            for name, submit in submits.items()}
    for run in runs.values():
        for _ in range(warmup):
            run.step(record=False)
    for done in range(0, steps, block):
        for run in runs.values():
            for _ in range(min(block, steps - done)):
                run.step()
    for run in runs.values():
        run.finish()
    return {name: run.times_ms for name, run in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--target", default=None, help="checkpoint to time instead of a random one")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    import ray
    import torch

    from engine.execution.ray_executor import RayExecutor
    from workers.target_worker import TargetWorker

    threads = int(os.environ.get("SPECSERVE_WORKER_THREADS", "1"))
    torch.set_num_threads(threads)
    tmp = tempfile.TemporaryDirectory(prefix="specserve-tp-step-")
    target = args.target or make_random_checkpoint(
        os.path.join(tmp.name, "target"), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
        heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate)
    # Batch sizes run one after another: the next one's prefill overwrites the same KV blocks.
    blocks = max(sum(len(t) for t in _tables(b, args.prompt_len + args.steps + args.warmup + 1)) for b in batches)
    wcfg = WorkerConfig(target, num_blocks=blocks + 1, block_size=BLOCK)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    executors = {tp: RayExecutor(ParallelConfig(tensor_parallel_size=tp, backend="ray", worker_threads=threads), wcfg,
                                 None) for tp in (1, 2)}
    try:
        local = TargetWorker(wcfg)
        submits: dict[str, Any] = {"in-process TP=1": local.step}
        for tp, ex in executors.items():
            def submit(msg: TargetStep, ex: RayExecutor = ex) -> Any:
                ex.submit_target(msg)
                return ex.wait_target()

            submits[f"Ray TP={tp}"] = submit
        by_batch = {b: time_decode(submits, b, args.prompt_len, args.steps, args.warmup) for b in batches}
    finally:
        for ex in executors.values():
            ex.shutdown()
    results = {name: {b: by_batch[b][name] for b in batches} for name in submits}

    load = os.getloadavg()
    print(f"\ntarget step, decode, {args.steps} steps after {args.warmup} warm-up; model hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}, {args.heads} heads; {threads} torch thread(s) per rank; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    names = list(results)
    print(f"{'batch':>5} | " + " | ".join(f"{n:>22}" for n in names) + " | TP=2 / TP=1 (Ray)")
    print(f"{'':>5} | " + " | ".join(f"{'median ms':>11}{'p90 ms':>11}" for _ in names) + " |")
    rows = []
    for b in batches:
        meds = {n: statistics.median(results[n][b]) for n in names}
        cells = " | ".join(f"{meds[n]:>11.2f}{percentile(results[n][b], 0.9):>11.2f}" for n in names)
        ratio = meds["Ray TP=2"] / meds["Ray TP=1"]
        print(f"{b:>5} | {cells} | {ratio:>6.2f}x")
        rows.append({"batch": b, "ratio_tp2_over_tp1": ratio, **{
            n: {"median_ms": meds[n], "p90_ms": percentile(results[n][b], 0.9)} for n in names}})
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                                 "heads": args.heads}, "threads_per_rank": threads, "cpus": os.cpu_count(),
                       "load_average": load, "steps": args.steps, "rows": rows}, f, indent=2)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
