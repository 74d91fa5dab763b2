"""The numbers of one load test, from its per-request records, under ``vllm bench serve``'s field names.

Latency statistics cover the requests that succeeded; failed and timed-out requests are counted (``failed``),
listed with their errors, and kept among the records. ITL statistics are over every gap of every request;
TTFT, TPOT and E2EL over requests. Percentiles interpolate linearly (numpy's default, as vLLM).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from benchmarks.openai_stream import RequestRecord

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms}")
        out[name] = ms
    return out


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--percentiles takes numbers separated by commas, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return ps


def _pname(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}".replace(".", "_")


def latency_stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean_/median_/std_/pXX_{name}_ms; None when there is nothing to measure."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {}
    empty = a.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(a.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(a))
    out[f"std_{name}_ms"] = None if empty else float(a.std())
    for p in percentiles:
        out[f"{_pname(p)}_{name}_ms"] = None if empty else float(np.percentile(a, p))
    return out


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once, on the client's clock (send to end of response)."""
    events = []
    for r in records:
        if r.e2el is not None:
            events += [(r.send_time, 1), (r.send_time + r.e2el, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant as a start frees its slot first
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def is_good(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(values[k] is not None and values[k] * 1000.0 <= ms for k, ms in slo_ms.items())


def summarize(records: list[RequestRecord], duration_s: float, percentiles: list[float],
              goodput_ms: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": (sum(is_good(r, goodput_ms) for r in records) / dur) if goodput_ms else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_concurrent_requests": peak_concurrency(records),
        "output_tokens_from_usage": sum(r.output_tokens_source == "usage" for r in ok),
    }
    out.update(latency_stats("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles))
    out.update(latency_stats("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles))
    out.update(latency_stats("itl", [g for r in ok for g in r.itl], percentiles))
    out.update(latency_stats("e2el", [r.e2el for r in ok if r.e2el is not None], percentiles))
    out["errors"] = dict(Counter(r.error for r in records if not r.success).most_common())
    return out


def format_summary(result: dict[str, Any], percentiles: list[float]) -> str:
    """A short human-readable block, like vllm bench serve's."""
    lines = [f"{'Successful requests:':<40}{result['completed']:>12}",
             f"{'Failed requests:':<40}{result['failed']:>12}",
             f"{'Benchmark duration (s):':<40}{result['duration']:>12.2f}",
             f"{'Total input tokens:':<40}{result['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<40}{result['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<40}{result['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:>12.2f}",
             f"{'Peak concurrent requests:':<40}{result['max_concurrent_requests']:>12}"]
    if result.get("request_goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result['request_goodput']:>12.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for key in ["mean", "median"] + [_pname(p) for p in percentiles]:
            v = result.get(f"{key}_{name}_ms")
            lines.append(f"{key.upper() + ' ' + name.upper() + ' (ms):':<40}{'-' if v is None else f'{v:.2f}':>12}")
    sd = result.get("spec_decode")
    if sd and sd.get("num_drafts"):
        lines.append(f"{'-' * 15}Speculative Decoding{'-' * 15}")
        lines.append(f"{'Acceptance rate:':<40}{sd['acceptance_rate']:>12.3f}")
        lines.append(f"{'Mean acceptance length:':<40}{sd['mean_acceptance_length']:>12.2f}")
        rates = sd.get("per_position_acceptance_rate") or []
        lines.append("Per-position acceptance: " + ", ".join(f"{x:.2f}" for x in rates))
        if sd.get("chosen_depths"):
            lines.append("Depths chosen (rounds): " + ", ".join(f"{k}: {n}" for k, n in sd["chosen_depths"].items()))
    pc = result.get("prefix_cache")
    if pc and pc.get("queries"):
        lines.append(f"{'-' * 15}Prefix Cache{'-' * 15}")
        lines.append(f"{'Prefix cache hit rate (tokens):':<40}{pc['hit_rate']:>12.3f}")
    if result.get("errors"):
        lines.append("Errors: " + "; ".join(f"{n} x {e}" for e, n in result["errors"].items()))
    return "\n".join(lines)
