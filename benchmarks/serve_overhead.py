"""What the HTTP server costs: TTFT and inter-token latency at concurrency 1, through ``specserve serve`` vs
``LLM.stream`` in this process, and output tokens/s at concurrency N through the server.

    python -m benchmarks.serve_overhead [--requests 8] [--max-tokens 64] [--concurrency 32] [--json out]

Both engines (this process's and the server's) are built from the same flags (the built-in pair by default)
and run the same greedy prompts (engine/default_models/prompts.jsonl). At concurrency 1 the two take turns,
request by request, so a change in machine load hits both alike. ITL is the time between successive outputs
(a speculative round delivers several tokens at once); TPOT is (e2e - TTFT) / (tokens - 1) per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine.core.config import DEFAULT_MODELS_DIR


def _prompts(n: int) -> list[str]:
    lines = (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()
    return [json.loads(ln)["prompt"] for ln in lines[:n]]


def _timing(start: float, times: list[float], tokens: int) -> dict:
    ttft = times[0] - start
    e2e = times[-1] - start
    return {"ttft": ttft, "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None, "e2e": e2e, "tokens": tokens}


def in_process(llm, prompt: str, params) -> dict:
    start, times, tokens = time.perf_counter(), [], 0
    for d in llm.stream([prompt], params):
        if d.new_token_ids:
            times.append(time.perf_counter())
            tokens += len(d.new_token_ids)
    return _timing(start, times, tokens)


async def through_server(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, times, tokens = time.perf_counter(), [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return _timing(start, times, tokens)


def _summary(rows: list[dict]) -> dict:
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    ttft = [r["ttft"] for r in rows]
    itl = [x for r in rows for x in r["itl"]]
    tpot = [r["tpot"] for r in rows if r["tpot"] is not None]
    ms = 1000.0
    return {"requests": len(rows), "ttft_ms_median": statistics.median(ttft) * ms, "ttft_ms_p90": pct(ttft, 0.9) * ms,
            "itl_ms_median": statistics.median(itl) * ms, "itl_ms_p90": pct(itl, 0.9) * ms,
            "tpot_ms_median": statistics.median(tpot) * ms, "tokens_per_output": len(itl) and
            sum(r["tokens"] - 1 for r in rows) / len(itl)}


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--max-queue", "1024",
           "--data-dir", tempfile.mkdtemp(prefix="specserve-bench-"), *flags]  # not a running server's job store
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(300)
    if not box or not box[0].startswith("specserve: serving on "):
        proc.kill()
        raise RuntimeError(f"the server did not start: {box}")
    return proc, box[0].split(" on ", 1)[1].strip()


async def run(args: argparse.Namespace) -> dict:
    import httpx

    from engine.core.args import EngineArgs
    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    flags = args.engine_flags
    proc, url = start_server(flags)
    try:
        ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(flags)
        llm = LLM(**{k: v for k, v in vars(EngineArgs.from_cli_args(ns)).items()})
        model = args.model or (ns.target or "specserve-default")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        prompts = _prompts(args.requests)
        async with httpx.AsyncClient(timeout=600) as http:
            # Warm-up: one request each way (first-call costs are not the server's overhead).
            in_process(llm, prompts[0], params)
            await through_server(http, url, model, prompts[0], args.max_tokens)
            local, served = [], []
            for p in prompts:  # taking turns: both see the same machine load
                local.append(in_process(llm, p, params))
                served.append(await through_server(http, url, model, p, args.max_tokens))
            # Concurrency N through the server: N streams at once, each its own prompt.
            conc = [_prompts(64)[i % 64] for i in range(args.concurrency)]
            t0 = time.perf_counter()
            rows = await asyncio.gather(*[through_server(http, url, model, p, args.max_tokens) for p in conc])
            wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = llm.generate(conc, params)
        local_wall = time.perf_counter() - t0
        llm.shutdown()
    finally:
        proc.terminate()
        proc.wait(30)
    out_tokens = sum(r["tokens"] for r in rows)
    result = {
        "engine_flags": flags, "max_tokens": args.max_tokens,
        "concurrency_1": {"in_process_LLM_stream": _summary(local), "server": _summary(served)},
        f"concurrency_{args.concurrency}": {
            "server_output_tokens_per_s": out_tokens / wall, "server_wall_s": wall, "output_tokens": out_tokens,
            "server_ttft_ms_median": statistics.median(r["ttft"] for r in rows) * 1000,
            "in_process_LLM_generate_output_tokens_per_s": sum(len(o.token_ids) for o in batch) / local_wall},
        "load_average": os.getloadavg(),
    }
    c1 = result["concurrency_1"]
    c1["server_overhead_ms"] = {k: c1["server"][k] - c1["in_process_LLM_stream"][k]
                                for k in ("ttft_ms_median", "itl_ms_median", "tpot_ms_median")}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="requests at concurrency 1 (each way)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--model", default=None, help="served model name (default: as specserve serve names it)")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("engine_flags", nargs=argparse.REMAINDER, help="engine flags for both, after --")
    args = p.parse_args(argv)
    if args.engine_flags[:1] == ["--"]:
        args.engine_flags = args.engine_flags[1:]
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
