"""``specserve`` command line: ``specserve generate --input in.jsonl --output out.jsonl``."""

from __future__ import annotations

import argparse
import json
import sys

from engine.args import EngineArgs
from engine.batch_job import run_batch
from engine.llm_engine import LLMEngine


def cmd_generate(args: argparse.Namespace) -> int:
    defaults = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature}.items()
                if v is not None}
    with open(args.input, encoding="utf-8") as f:
        lines = f.read().splitlines()
    engine = LLMEngine(EngineArgs.from_cli_args(args).to_engine_config())
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
    EngineArgs.add_cli_args(g)
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
