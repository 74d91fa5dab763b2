"""``specserve`` command line: ``specserve generate --input in.jsonl --output out.jsonl``."""

from __future__ import annotations

import argparse
import json
import sys

from engine.batch_job import run_batch
from engine.config import CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig, default_model_dirs
from engine.llm_engine import LLMEngine
from scheduler.scheduler import SchedulerConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (Hugging Face format); default: the built-in pair")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'; '
                        "tree keys: tree_branching, tree_sampling, max_tree_nodes. With no --target the built-in "
                        "draft is used unless this is 'none'")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the checkpoint's; "
                   "float32 for half-precision checkpoints on CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-tokens", type=int, default=None, help="KV pool size per model, in tokens")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="target ranks (Ray actors)")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one if needed)")
    p.add_argument("--transport", choices=["zmq", "ray"], default="zmq",
                   help="per-round messages to Ray workers: msgpack over zmq (default) or Ray actor calls")
    p.add_argument("--placement-timeout", type=float, default=60.0,
                   help="seconds to wait for Ray to place the workers before failing with what is missing")
    p.add_argument("--max-worker-restarts", type=int, default=3,
                   help="Ray workers that die are replaced and their requests re-prefilled, up to this many "
                        "times in 10 minutes; then the job stops naming every failure (0: never restart)")
    p.add_argument("--distributed-executor-backend", choices=["uni", "ray"], default=None,
                   help="uni: workers in this process (tp 1 only); ray: Ray actors. Default: ray when "
                        "tensor parallelism or --address asks for it")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    target, spec = args.target, args.speculative_config
    if isinstance(spec, str) and spec.strip().lower() in ("none", "null", ""):
        spec = "none"
    if target is None:
        target, draft = default_model_dirs()
        if spec is None:
            spec = {"method": "draft_model", "model": draft}
    spec_cfg = None if spec == "none" else SpeculativeConfig.parse(spec)
    return EngineConfig(
        target=target, speculative=spec_cfg, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  block_size=args.block_size),
        cache=CacheConfig(block_size=args.block_size, num_kv_tokens=args.num_kv_tokens),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, address=args.address,
                                backend=args.distributed_executor_backend, transport=args.transport,
                                placement_timeout_s=args.placement_timeout,
                                max_worker_restarts=args.max_worker_restarts))


def cmd_generate(args: argparse.Namespace) -> int:
    defaults = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature}.items()
                if v is not None}
    with open(args.input, encoding="utf-8") as f:
        lines = f.read().splitlines()
    engine = LLMEngine(engine_config_from_args(args))
    try:
        with open(args.output, "w", encoding="utf-8") as out:
            summary = run_batch(engine, lines, out, defaults, progress=not args.no_progress)
    finally:
        engine.shutdown()
    print(json.dumps(summary), file=sys.stderr)
    if "engine_error" in summary:
        print(f"specserve: error: {summary['engine_error']} (finished requests were written to {args.output})",
              file=sys.stderr)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.benchmarks import compare

    return compare.main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description="lossless speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run a JSONL batch job")
    _add_engine_args(g)
    g.add_argument("--input", required=True, help="JSONL: one request per line (see README)")
    g.add_argument("--output", required=True, help="JSONL results, in input order")
    g.add_argument("--max-tokens", type=int, default=None, help="default max_tokens for lines without one")
    g.add_argument("--temperature", type=float, default=None, help="default temperature for lines without one")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="benchmarks: 'compare' runs every decoding mode side by side")
    b.add_argument("name", choices=["compare"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (see --help after the name)")
    b.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
