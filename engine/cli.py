"""``specserve`` command line: ``specserve generate --input in.jsonl --output out.jsonl``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading

from engine.core.args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.jobs import cli as batch_cli
from engine.jobs.generate import OutputWriteError, ResumePoint, resume_point, run_batch
from engine.jobs.jsonl import count_lines, iter_lines
from engine.server import cli as server_cli


def cmd_generate(args: argparse.Namespace) -> int:
    """Exit status: 0 every line succeeded; 1 some lines have error lines (or the engine failed mid-job);
    2 nothing ran (bad arguments, unreadable input, unwritable output, the model failed to load);
    3 the output could not be written mid-job (disk full): the lines written are intact, rerun with --resume."""
    defaults = {k: v for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature}.items()
                if v is not None}
    with open(args.input, "rb"):  # readable before anything else is done
        pass
    resumed = ResumePoint(0, 0)
    if args.resume and os.path.exists(args.output):
        with open(args.input, "rb") as f:
            resumed = resume_point(args.output, iter_lines(f))
    # Opened (so checked writable) before the model loads: a bad path fails in a second, not after loading.
    out = open(args.output, "a" if args.resume else "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        total = None if args.no_progress else count_lines(args.input)
        engine = LLMEngine.create(EngineArgs.from_cli_args(args).to_engine_config())
        try:
            with _sigterm_as_exit(), open(args.input, "rb") as f:
                summary = run_batch(engine, iter_lines(f), out, defaults, progress=not args.no_progress,
                                    skip=resumed.lines, total=total)
        except OutputWriteError as e:
            print(f"specserve: error: {e.strerror}; the lines written to {args.output} are complete and in "
                  "order: free space and rerun with --resume", file=sys.stderr)
            return 3
        finally:
            engine.shutdown()
    finally:
        with contextlib.suppress(OSError):  # each line was flushed; only a failed write can be left to retry
            out.close()
    if resumed.lines:  # the whole output's counts: the kept lines are part of the result
        summary["requests"] += resumed.lines
        summary["errors"] += resumed.errors
    print(json.dumps(summary), file=sys.stderr)
    if "engine_error" in summary:
        print(f"specserve: error: {summary['engine_error']} (finished requests were written to {args.output}; "
              "--resume runs the unfinished ones)", file=sys.stderr)
        return 1
    return 1 if summary["errors"] else 0


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM unwinds like Ctrl-C (workers shut down); every line written so far is already flushed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.name == "serve":
        from benchmarks import serve

        return serve.main(args.rest)
    if args.name == "sweep":
        from benchmarks import sweep

        return sweep.main(args.rest)
    if args.name == "simulate":
        from benchmarks import simulate

        return simulate.main(args.rest)
    from benchmarks import compare

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
    g.add_argument("--resume", action="store_true",
                   help="keep the lines an earlier (killed) run wrote to --output and run only the rest")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="benchmarks: 'compare' runs every decoding mode side by side")
    b.add_argument("name", choices=["compare", "serve", "simulate", "sweep"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (see --help after the name)")
    b.set_defaults(func=cmd_bench)
    server_cli.add_parser(sub)
    batch_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
