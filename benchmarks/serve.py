"""``specserve bench serve``: a load test against any OpenAI-compatible streaming server (specserve, vLLM,
SGLang). A client only: it sends the requests at gamma-process arrival times (``--request-rate``,
``--burstiness``), at most ``--max-concurrency`` in flight, times every streamed chunk on its own clock, and
writes ``vllm bench serve``'s fields plus per-request records and the server's speculative-decoding statistics.

    specserve bench serve --base-url http://127.0.0.1:8000 --dataset prompts.jsonl --num-prompts 64 \\
        --request-rate 4 --max-concurrency 8 --result-file run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from benchmarks.openai_stream import CHAT, COMPLETIONS, RequestRecord, fetch_model_id, request_body, send_request
from benchmarks.serve_report import format_summary, parse_goodput, parse_percentiles, summarize
from benchmarks.server_metrics import QueueSampler, prefix_cache_delta, scrape, spec_decode_delta
from benchmarks.workload import (
    BenchRequest,
    arrival_offsets,
    load_jsonl,
    prefix_repetition_requests,
    random_requests,
)

DEFAULT_DATASET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "default_models",
                               "prompts.jsonl")


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first model the server lists, if it lists one
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 95.0, 99.0])
    goodput_ms: dict[str, float] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 1.0  # queue sampling from /metrics; 0: off
    progress: bool = True
    keep_text: bool = False

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in (COMPLETIONS, CHAT):
            raise ValueError(f"--endpoint must be {COMPLETIONS} or {CHAT}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        self.percentiles = sorted(set(self.percentiles) | {99.0})  # p99 is one of vLLM's fixed fields


async def _run(cfg: BenchConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    url = cfg.base_url + cfg.endpoint
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    # The semaphore caps requests in flight, not the pool: a request must never wait for a connection (that
    # wait would count in its TTFT). /metrics goes through a client of its own for the same reason.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_concurrency)
    # httpx's own timeouts bound each read; send_request bounds the whole request.
    timeout = httpx.Timeout(cfg.request_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as metrics_client:
        model = cfg.model or await fetch_model_id(metrics_client, cfg.base_url, headers)
        bodies = [request_body(r, cfg.endpoint, model) for r in requests]  # refuse bad input before sending
        before = await scrape(metrics_client, cfg.base_url, headers)
        sampler = None
        if before is not None and cfg.metrics_interval_s > 0:
            sampler = QueueSampler(metrics_client, cfg.base_url, cfg.metrics_interval_s, headers)
            sampler.start()
        records = [RequestRecord(i, r.request_id) for i, r in enumerate(requests)]
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = None
        if cfg.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="bench serve", unit="req", file=sys.stderr)

        async def one(i: int) -> None:
            if sem is not None:
                async with sem:  # an arrival waits here for a slot: its clock starts when it is sent
                    await send_request(client, url, bodies[i], records[i], t0, headers, cfg.request_timeout_s,
                                       cfg.keep_text)
            else:
                await send_request(client, url, bodies[i], records[i], t0, headers, cfg.request_timeout_s,
                                   cfg.keep_text)
            if bar is not None:
                bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for i, off in enumerate(offsets):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        server_load = await sampler.stop() if sampler is not None else None
        after = await scrape(metrics_client, cfg.base_url, headers)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == CHAT else "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "percentiles": cfg.percentiles,
        "goodput_config": cfg.goodput_ms or None,
        # the client's time.perf_counter() at the start (send_time is relative to it): on Linux the host's
        # monotonic clock, so a server on the same host can align its own timestamps with the records
        "clock_start": t0,
    }
    result.update(summarize(records, duration, cfg.percentiles, cfg.goodput_ms))
    result["spec_decode"] = spec_decode_delta(before, after)
    result["prefix_cache"] = prefix_cache_delta(before, after)
    result["server_load"] = server_load
    result["requests"] = [r.to_json() for r in records]
    return result


def run_benchmark(cfg: BenchConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    """Runs one load test to the end (every request finished, failed or timed out); returns the result dict."""
    if not requests:
        raise ValueError("no requests to send")
    return asyncio.run(_run(cfg, requests))


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared with ``bench sweep``: what to send."""
    ap.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    ap.add_argument("--model", default=None, help="model name in the requests (default: the server's first)")
    ap.add_argument("--dataset", default=None, help="JSONL in the `specserve generate` request format "
                    "(default: the built-in prompts, unless --random-input-len is given)")
    ap.add_argument("--random-input-len", type=int, default=None, help="random token-id prompts of this length")
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-token-range", default="100,1000",
                    help="MIN,MAX: random prompt token ids are drawn from [MIN, MAX)")
    ap.add_argument("--prefix-repetition-prefix-len", type=int, default=None,
                    help="shared-prefix prompts (vLLM's prefix_repetition dataset): random prefixes of this length")
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=64, help="each request's own suffix")
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=4, help="distinct prefixes")
    ap.add_argument("--prefix-repetition-output-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens for dataset lines without one")
    ap.add_argument("--output-len", type=int, default=None, help="max_tokens for every dataset line (overrides)")
    ap.add_argument("--temperature", type=float, default=None, help="temperature for dataset lines without one")
    ap.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM's extension)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                    help="service-level objectives, e.g. ttft:500 tpot:50 e2el:5000")
    ap.add_argument("--percentiles", default="50,90,95,99")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request, then failed")
    ap.add_argument("--metrics-interval", type=float, default=1.0,
                    help="seconds between /metrics samples of the server's queue (0: off)")
    ap.add_argument("--no-progress", action="store_true")


def build_requests(args: argparse.Namespace, num_prompts: int) -> list[BenchRequest]:
    defaults: dict[str, Any] = {}
    if args.ignore_eos:
        defaults["ignore_eos"] = True
    if args.temperature is not None:
        defaults["temperature"] = args.temperature
    if args.prefix_repetition_prefix_len is not None:
        if args.dataset is not None or args.random_input_len is not None:
            raise ValueError("give one of --dataset, --random-input-len, --prefix-repetition-prefix-len")
        lo, _, hi = args.random_token_range.partition(",")
        return prefix_repetition_requests(num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len, (int(lo), int(hi)), args.seed, defaults)
    if args.random_input_len is not None:
        if args.dataset is not None:
            raise ValueError("give either --dataset or --random-input-len, not both")
        lo, _, hi = args.random_token_range.partition(",")
        return random_requests(num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                               (int(lo), int(hi)), args.seed, defaults)
    if args.max_tokens is not None:
        defaults["max_tokens"] = args.max_tokens
    reqs = load_jsonl(args.dataset or DEFAULT_DATASET, num_prompts, defaults)
    if args.output_len is not None:
        for r in reqs:
            r.params["max_tokens"] = args.output_len
    return reqs


def config_from_args(args: argparse.Namespace, base_url: str, request_rate: float,
                     max_concurrency: int | None) -> BenchConfig:
    return BenchConfig(
        base_url=base_url, endpoint=args.endpoint, model=args.model, request_rate=request_rate,
        burstiness=args.burstiness, max_concurrency=max_concurrency, seed=args.seed,
        percentiles=parse_percentiles(args.percentiles), goodput_ms=parse_goodput(args.goodput),
        api_key=args.api_key, request_timeout_s=args.request_timeout, metrics_interval_s=args.metrics_interval,
        progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--save-text", action="store_true", help="keep generated text in the per-request records")
    ap.add_argument("--result-file", default=None, help="write the JSON result here")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    cfg = config_from_args(args, args.base_url, args.request_rate, args.max_concurrency)
    cfg.keep_text = args.save_text
    result = run_benchmark(cfg, build_requests(args, args.num_prompts))
    print(format_summary(result, cfg.percentiles))
    if args.result_file:
        d = os.path.dirname(os.path.abspath(args.result_file))
        os.makedirs(d, exist_ok=True)
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0 if result["completed"] else 1
