"""The memory floor of a decode step: target weight bytes / measured copy bandwidth, and what we measure beside it.

A batch-1 decode step must read every weight once, so ``weight bytes / bandwidth`` is the least it can take on
this machine; ``step / floor`` says how far the engine (scheduling, messaging, sampling, the forward) is from it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def copy_bandwidth(mbytes: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a large tensor copy, counting bytes read plus bytes written (median over repeats)."""
    n = mbytes * (1 << 20) // 4
    src = torch.ones(n)
    dst = torch.zeros(n)  # both touched, so page faults are not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads (a tied embedding / LM head counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_step_times(llm: Any, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds of each engine ``step()`` after the prefill step, one greedy request alone."""
    from engine import SamplingParams

    eng = llm.engine
    eng.add_request("step-timing", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = []
    while eng.has_unfinished:
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_floor(llm: Any, hf_model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                  repeats: int) -> dict:
    """Batch-1 decode step (engine, no speculation) against the weights/bandwidth floor."""
    steps: list[float] = []
    for _ in range(repeats):
        for p in prompts:
            steps += decode_step_times(llm, p, max_tokens)
    step_s = statistics.median(steps)
    bw = copy_bandwidth()
    wbytes = weight_bytes(hf_model)
    floor_s = wbytes / bw
    return {
        "decode_step_s": step_s,
        "weight_bytes": wbytes,
        "copy_bandwidth_bytes_per_s": bw,
        "weight_bytes_over_bandwidth_s": floor_s,
        "step_over_floor": step_s / floor_s,
    }


def report_floor(s: dict) -> None:
    print(f"\ndecode step, batch 1, no speculation: {1e3 * s['decode_step_s']:.2f} ms per step\n"
          f"  floor: {s['weight_bytes'] / 1e6:.1f} MB of target weights / {s['copy_bandwidth_bytes_per_s'] / 1e9:.1f}"
          f" GB/s copy bandwidth (read + write) = {1e3 * s['weight_bytes_over_bandwidth_s']:.2f} ms; "
          f"step / floor = {s['step_over_floor']:.2f}x")
