"""``specserve bench sweep``: load ladders for several server configurations, side by side.

For each configuration (a ``--speculative-config`` value for a ``specserve serve`` the sweep starts and
stops itself, or the URL of a running server) it runs ``bench serve`` at each rung of a concurrency ladder or
a request-rate ladder, from low load to past saturation, finds the saturation knee, and writes one JSON with
everything, a markdown table and PNG plots into ``--out-dir``.

    specserve bench sweep --config off=none --config chain4='{"num_speculative_tokens": 4, "adaptive": false}' \\
        --concurrency 1,2,4,8,16 --num-prompts 16 --max-tokens 64 --out-dir runs/sweep

Each rung sends max(--num-prompts, --prompts-per-concurrency x concurrency) requests, so that high rungs
reach a steady state. Climbing stops ``--stop-past-knee`` rungs past the knee (0: run the whole ladder).
``--interleave`` starts every server first and runs each rung on every configuration in turn (``--repeats``
times, keeping the median), so that a slow drift of a shared machine does not land in the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from benchmarks.knee import find_knee, stop_climbing
from benchmarks.serve import add_workload_args, build_requests, config_from_args, run_benchmark
from benchmarks.server_process import ServerProcess, serve_command
from benchmarks.sweep_report import fmt, markdown, plot


@dataclass
class ServerConfig:
    name: str
    speculative_config: str | None = None  # JSON, or "none"; for a server the sweep starts
    url: str | None = None  # a server already running

    def __post_init__(self) -> None:
        if (self.speculative_config is None) == (self.url is None):
            raise ValueError(f"configuration {self.name!r} needs exactly one of a speculative config or a URL")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", self.name):
            raise ValueError(f"configuration name {self.name!r}: use letters, digits and _ . + - only")


def _named(items: list[str] | None, prefix: str) -> list[tuple[str, str]]:
    out = []
    for i, item in enumerate(items or []):
        m = re.match(r"([A-Za-z0-9_.+-]+)=(.*)", item, re.DOTALL)
        out.append((m.group(1), m.group(2).strip()) if m else (f"{prefix}{i}", item.strip()))  # no NAME=: numbered
    return out


def parse_configs(configs: list[str] | None, urls: list[str] | None, server_args: list[str]) -> list[ServerConfig]:
    """``--config NAME=JSON|none`` and ``--url NAME=URL``, in the order given (the first is the baseline)."""
    out = [ServerConfig(n, speculative_config=_with_default_draft(v, server_args))
           for n, v in _named(configs, "config")]
    out += [ServerConfig(n, url=v.rstrip("/")) for n, v in _named(urls, "url")]
    if not out:
        raise ValueError("give at least one --config NAME=JSON (a server to start) or --url NAME=URL")
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ, got {names}")
    return out


def _with_default_draft(spec: str, server_args: list[str]) -> str:
    """A config without a draft ``model`` gets the built-in draft when the server runs the built-in target."""
    if spec.strip().lower() in ("none", "null", ""):
        return "none"
    try:
        obj = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {spec!r} is not JSON (or 'none'): {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--config {spec!r}: expected a JSON object")
    if "model" not in obj and "--target" not in server_args:
        from engine.core.config import default_model_dirs

        obj["model"] = default_model_dirs()[1]
    return json.dumps(obj)


def parse_ladder(concurrency: str | None, rates: str | None) -> tuple[str, list[float]]:
    if (concurrency is None) == (rates is None):
        raise ValueError("give exactly one of --concurrency C1,C2,... or --request-rates R1,R2,...")
    kind, text = ("concurrency", concurrency) if concurrency is not None else ("request_rate", rates)
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{kind.replace('_', '-')} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not v > 0 for v in values) or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"the ladder must be positive and increasing, got {text!r}")
    if kind == "concurrency" and any(not v.is_integer() for v in values):
        raise ValueError(f"concurrency rungs must be whole numbers, got {text!r}")
    return kind, values


def run_rung(url: str, kind: str, v: float, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One rung of the ladder against one server: its ``bench serve`` result."""
    if kind == "concurrency":
        rate, cap = math.inf, int(v)
        n = max(args.num_prompts, args.prompts_per_concurrency * int(v))
    else:
        rate, cap, n = v, args.max_concurrency, args.num_prompts
    result = run_benchmark(config_from_args(args, url, rate, cap), build_requests(args, n))
    load: Any = int(v) if kind == "concurrency" else (v if math.isfinite(v) else "inf")
    print(f"[{name}] {kind} {load}: {result['output_throughput']:.1f} out tok/s, "
          f"TTFT p50 {fmt(result['median_ttft_ms'], 0)} ms, "
          f"TPOT p50 {fmt(result['median_tpot_ms'])} ms, failed {result['failed']}",
          file=sys.stderr, flush=True)
    return {"load": load, "num_prompts": n, "result": result}


def _climbing_stops(values: list[float], points: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    return stop_climbing(values[:len(points)], [p["result"]["output_throughput"] for p in points],
                         args.stop_past_knee, args.knee_tolerance)


def _knee(values: list[float], points: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    knee = find_knee(values[:len(points)], [p["result"]["output_throughput"] for p in points],
                     [p["result"]["median_ttft_ms"] for p in points],
                     [(p["result"].get("server_load") or {}).get("mean_waiting") for p in points],
                     args.knee_tolerance)
    return {"points": points, "knee": knee.to_json()}


def run_interleaved(configs: list[ServerConfig], kind: str, values: list[float], args: argparse.Namespace,
                    server_args: list[str]) -> list[dict[str, Any]]:
    """The configurations' servers up at once, each rung run on every configuration in turn, ``--repeats`` times
    in rotating order, keeping the run of median throughput. On a shared machine throughput drifts by tens of
    percent over minutes (the same server and rung gave 227 and 309 out tok/s ten minutes apart on the 2-core CI
    machine); run one configuration's whole ladder after another's and the drift lands in their ratios. Without
    ``--interleave`` this runs for one configuration at a time (its server stopped before the next starts)."""
    entries: list[dict[str, Any]] = [{"name": c.name, "speculative_config": c.speculative_config, "url": c.url}
                                     for c in configs]
    points: list[list[dict[str, Any]]] = [[] for _ in configs]
    with contextlib.ExitStack() as stack:
        live: list[int] = []
        for i, (c, e) in enumerate(zip(configs, entries, strict=True)):
            try:
                if c.url is None:
                    e["server_command"] = serve_command(["--speculative-config", c.speculative_config, *server_args],
                                                        shlex.split(args.server_command) or None)
                    log = os.path.join(args.out_dir, f"server-{c.name}.log")
                    e["url"] = stack.enter_context(ServerProcess(e["server_command"], log, args.startup_timeout)).url
                warm_up(e["url"], args)
                live.append(i)
            except (RuntimeError, TimeoutError, ValueError, OSError) as err:
                e["error"] = f"{type(err).__name__}: {err}"
                print(f"[{c.name}] failed: {err}", file=sys.stderr, flush=True)
        climbing = list(live)
        for v in values:
            if not climbing:
                break
            runs: dict[int, list[dict[str, Any]]] = {i: [] for i in climbing}
            for rep in range(args.repeats):
                for i in climbing[rep % len(climbing):] + climbing[:rep % len(climbing)]:
                    try:
                        runs[i].append(run_rung(entries[i]["url"], kind, v, args, configs[i].name))
                    except (RuntimeError, TimeoutError, ValueError, OSError) as err:
                        entries[i]["error"] = f"{type(err).__name__}: {err}"
            for i, rs in runs.items():
                if not rs:
                    continue
                rs.sort(key=lambda p: p["result"]["output_throughput"])
                kept = dict(rs[(len(rs) - 1) // 2])  # the median (the lower one of an even count)
                kept["repeats_output_throughput"] = [p["result"]["output_throughput"] for p in rs]
                points[i].append(kept)
            climbing = [i for i in climbing if "error" not in entries[i]
                        and not _climbing_stops(values, points[i], args)]
    for e, ps in zip(entries, points, strict=True):
        if ps:
            e.update(_knee(values, ps, args))
    return entries


def warm_up(url: str, args: argparse.Namespace) -> None:
    """A few requests, one at a time, before measuring (first-call costs are not load)."""
    if args.warmup_requests > 0:
        cfg = config_from_args(args, url, math.inf, 1)
        cfg.progress, cfg.metrics_interval_s = False, 0.0
        run_benchmark(cfg, build_requests(args, args.warmup_requests))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench sweep", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", action="append", metavar="NAME=JSON",
                    help="a server to start: its --speculative-config ('none': no speculation; without 'model', "
                         "the built-in draft). Repeat; the first is the baseline of the ratios")
    ap.add_argument("--url", action="append", metavar="NAME=URL", help="a running server instead. Repeat")
    ap.add_argument("--server-args", default="", help="more `specserve serve` flags for every started server")
    ap.add_argument("--server-command", default="",
                    help="instead of `specserve serve`: a command that takes its flags and prints its ready line")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to become ready")
    ap.add_argument("--concurrency", default=None, help="concurrency ladder, e.g. 1,2,4,8,16")
    ap.add_argument("--request-rates", default=None, help="request-rate ladder (req/s), e.g. 0.5,1,2,4,inf")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap in flight on a rate ladder")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per rung (at least)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=3,
                    help="on a concurrency ladder, at least this many requests per slot")
    ap.add_argument("--stop-past-knee", type=int, default=2, help="rungs to run past the knee (0: all)")
    ap.add_argument("--knee-tolerance", type=float, default=0.05,
                    help="relative throughput gain below which load no longer counts as rising")
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first, then run each rung on every configuration in turn: the "
                         "machine's drift lands on all of them alike, not in their ratios")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --interleave: runs of each rung per configuration (rotating order); the run of "
                         "median throughput is kept, all of them are listed")
    ap.add_argument("--out-dir", required=True, help="sweep.json, sweep.md, *.png and server logs go here")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.prompts_per_concurrency < 0:
        raise ValueError("--num-prompts must be >= 1 and --prompts-per-concurrency >= 0")
    if not 1 <= args.repeats <= 20 or (args.repeats > 1 and not args.interleave):
        raise ValueError(f"--repeats takes 1 to 20 and needs --interleave, got {args.repeats}")
    server_args = shlex.split(args.server_args)
    configs = parse_configs(args.config, args.url, server_args)
    kind, values = parse_ladder(args.concurrency, args.request_rates)
    build_requests(args, 1)  # a bad dataset fails now, not after the first server started
    os.makedirs(args.out_dir, exist_ok=True)
    sweep: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": "specserve bench sweep " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "ladder": {"kind": kind, "values": [v if math.isfinite(v) else "inf" for v in values]},
        "configs": (run_interleaved(configs, kind, values, args, server_args) if args.interleave
                    else [e for c in configs for e in run_interleaved([c], kind, values, args, server_args)]),
    }
    with open(os.path.join(args.out_dir, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(sweep, f, indent=1)
    table = markdown(sweep)
    with open(os.path.join(args.out_dir, "sweep.md"), "w", encoding="utf-8") as f:
        f.write(table)
    if any(c.get("points") for c in sweep["configs"]):
        plot(sweep, args.out_dir)
    print(table)
    return 1 if any(c.get("error") for c in sweep["configs"]) else 0
