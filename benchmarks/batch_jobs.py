"""Batch API measurements on a real ``specserve serve`` (issue 12): server memory under a huge job, and online
latency while a job runs.

```
python -m benchmarks.batch_jobs rss  --lines 100000 --seconds 180    # server RSS: upload, validation, run
python -m benchmarks.batch_jobs ttft --job 2000 --probes 20           # TTFT at concurrency 1, idle vs job
python -m benchmarks.batch_jobs store --lines 100000                  # a whole job, no model: store memory
```

Both start the server in a subprocess (built-in pair unless ``--target``; any further flags go to ``serve``) on
a fresh data directory, and print one JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from engine.client import Client
from engine.core.config import DEFAULT_MODELS_DIR

PROMPTS = [json.loads(ln)["prompt"][:40] for ln in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()]


class Server:
    def __init__(self, data_dir: str, extra: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--data-dir",
                                      data_dir, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        line = lines.get(timeout=600)
        self.url = line.split()[-1]

    def rss_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) of the server process, MiB."""
        vals = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for ln in f:
                if ln.startswith(("VmRSS:", "VmHWM:")):
                    vals[ln.split(":")[0]] = int(ln.split()[1]) / 1024
        return vals["VmRSS"], vals["VmHWM"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _write_job(path: str, n: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                                         "temperature": 0}}) + "\n")


def cmd_rss(args: argparse.Namespace, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.jsonl")
        _write_job(src, args.lines, args.max_tokens)
        server = Server(os.path.join(tmp, "data"), extra)
        try:
            client = Client(server.url)
            base, _ = server.rss_mb()
            t0 = time.monotonic()
            job = client.submit_batch(src)
            while (b := job.status())["status"] == "validating":
                time.sleep(0.2)
            validated_s = time.monotonic() - t0
            after_validation, peak_validation = server.rss_mb()
            samples = []
            t1 = time.monotonic()
            while time.monotonic() - t1 < args.seconds and b["status"] == "in_progress":
                time.sleep(5)
                b = job.status()
                samples.append((round(time.monotonic() - t1), b["request_counts"]["completed"],
                                round(server.rss_mb()[0], 1)))
            run_s = time.monotonic() - t1
            final, peak = server.rss_mb()
            return {"lines": args.lines, "input_mb": round(os.path.getsize(src) / 2**20, 1),
                    "server_rss_mb": {"idle": round(base, 1), "after_upload_and_validation": round(after_validation, 1),
                                      "peak_through_validation": round(peak_validation, 1),
                                      "end": round(final, 1), "peak": round(peak, 1)},
                    "validation_s": round(validated_s, 1), "run_s": round(run_s, 1), "status": b["status"],
                    "completed": b["request_counts"]["completed"],
                    "requests_per_s": round(b["request_counts"]["completed"] / run_s, 1),
                    "samples_s_completed_rss": samples}
        finally:
            server.stop()


def cmd_store(args: argparse.Namespace, extra: list[str]) -> dict:
    """The whole life of a job (upload, validation, every request, finalization) through the store and runner
    with an instant stand-in for the engine: the store's own memory, without the model's."""
    import asyncio
    import resource

    from engine.jobs.runner import BatchRunner
    from engine.jobs.store import JobStore

    class Instant:
        async def execute(self, endpoint: str, body: dict, request_id: str) -> tuple[int, dict]:
            return 200, {"object": "text_completion", "choices": [{"index": 0, "text": body["prompt"][::-1],
                                                                   "finish_reason": "length"}]}

    def rss() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in.jsonl")
        _write_job(src, args.lines, 1)
        store = JobStore(os.path.join(tmp, "data"))
        base = rss()
        t0 = time.monotonic()
        with open(src, "rb") as f:
            fid = store.create_file(f, "in.jsonl", "batch")["id"]
        bid = store.create_batch(fid, "/v1/completions")["id"]

        async def run() -> dict:
            runner = BatchRunner(store, Instant(), max_in_flight=128, poll_s=0.05)
            runner.start()
            while (b := store.get_batch(bid))["status"] not in ("completed", "failed"):
                await asyncio.sleep(0.5)
            await runner.stop()
            return b

        b = asyncio.run(run())
        return {"lines": args.lines, "status": b["status"], "request_counts": b["request_counts"],
                "elapsed_s": round(time.monotonic() - t0, 1), "rss_mb_before": round(base, 1),
                "rss_mb_after": round(rss(), 1),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "output_mb": round(store.get_file(b["output_file_id"])["bytes"] / 2**20, 1)}


def _ttft(url: str, prompt: str, max_tokens: int) -> float:
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0, "stream": True}, timeout=300) as r:
        lines = r.iter_lines()
        for line in lines:
            data = line[5:].strip() if line.startswith("data:") else "[DONE]"
            choices = json.loads(data).get("choices") if data != "[DONE]" else None
            if choices and choices[0].get("text"):
                first = time.perf_counter() - t
                for _ in lines:  # drain: the request runs to its end, as a user's would
                    pass
                return first
    raise RuntimeError("no token came back")


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "mean_ms": round(1000 * statistics.mean(xs), 1),
            "p50_ms": round(1000 * xs[len(xs) // 2], 1), "p90_ms": round(1000 * xs[int(len(xs) * 0.9)], 1),
            "max_ms": round(1000 * xs[-1], 1)}


def cmd_ttft(args: argparse.Namespace, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(os.path.join(tmp, "data"), extra)
        try:
            probe = [PROMPTS[(7 * i) % len(PROMPTS)] for i in range(args.probes)]
            _ttft(server.url, probe[0], args.probe_tokens)  # warm-up
            idle = [_ttft(server.url, p, args.probe_tokens) for p in probe]
            src = os.path.join(tmp, "job.jsonl")
            _write_job(src, args.job, args.job_tokens)
            client = Client(server.url)
            job = client.submit_batch(src)
            while (b := job.status())["status"] == "validating" or b["request_counts"]["completed"] < 50:
                time.sleep(0.2)
            start_done = b["request_counts"]["completed"]
            busy = [_ttft(server.url, p, args.probe_tokens) for p in probe]
            b = job.status()
            return {"job_requests": args.job, "job_max_tokens": args.job_tokens, "probe_max_tokens": args.probe_tokens,
                    "ttft_idle": _stats(idle), "ttft_with_job_running": _stats(busy),
                    "job_completed_during_probes": b["request_counts"]["completed"] - start_done,
                    "job_status_after": b["status"]}
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_jobs", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("rss", help="server RSS while a huge job is uploaded, validated and run")
    r.add_argument("--lines", type=int, default=100_000)
    r.add_argument("--max-tokens", type=int, default=1)
    r.add_argument("--seconds", type=float, default=180.0, help="how long to let the job run before stopping")
    t = sub.add_parser("ttft", help="TTFT at concurrency 1, idle and with a batch job running")
    t.add_argument("--job", type=int, default=2000)
    t.add_argument("--job-tokens", type=int, default=16)
    t.add_argument("--probes", type=int, default=20)
    t.add_argument("--probe-tokens", type=int, default=4)
    st = sub.add_parser("store", help="a whole job through the store and runner, no model (store memory only)")
    st.add_argument("--lines", type=int, default=100_000)
    args, extra = p.parse_known_args(argv)
    out = {"rss": cmd_rss, "ttft": cmd_ttft, "store": cmd_store}[args.mode](args, extra)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
