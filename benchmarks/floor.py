"""The memory floor of a decode step: target weight bytes / measured copy bandwidth, and what we measure beside it.

A batch-1 decode step must read every weight once, so ``weight bytes / bandwidth`` is the least it can take on
this machine; ``step / floor`` says how far the engine (scheduling, messaging, sampling) and the bare target
forward are from it.
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
    from scheduler.sampling_params import SamplingParams

    eng = llm.engine
    eng.add_request("step-timing", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = []
    while eng.has_unfinished:
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def target_runner(llm: Any) -> Any:
    """The in-process target worker's model runner, when the executor is local (else None)."""
    ex = getattr(llm.engine, "executor", None)
    worker = getattr(ex, "target", None)
    return getattr(worker, "runner", None)


def time_forward_decode(runner: Any, context: int, repeats: int) -> float | None:
    """Median seconds of one batch-1 decode forward at ``context`` cached tokens (target model only)."""
    if runner is None:
        return None
    from workers.input_batch import SeqForward

    bs = runner.block_size
    blocks = list(range(-(-(context + 1) // bs)))
    if len(blocks) > runner.cache.num_blocks:
        return None
    runner.forward([SeqForward(blocks, 0, list(range(-1, context - 1)), [1] * context)])  # fill the cache
    piece = [SeqForward(blocks, context, [-1], [1], logit_nodes=[0])]
    for _ in range(3):
        runner.forward(piece)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(piece)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_floor(llm: Any, hf_model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                  repeats: int) -> dict:
    """Batch-1 decode step (engine, no speculation) and target forward against the weights/bandwidth floor."""
    steps: list[float] = []
    for _ in range(repeats):
        for p in prompts:
            steps += decode_step_times(llm, p, max_tokens)
    step_s = statistics.median(steps)
    forward_s = time_forward_decode(target_runner(llm), len(prompts[0]) + max_tokens // 2, 50)
    bw = copy_bandwidth()
    wbytes = weight_bytes(hf_model)
    floor_s = wbytes / bw
    return {
        "decode_step_s": step_s,
        "decode_forward_s": forward_s,
        "weight_bytes": wbytes,
        "copy_bandwidth_bytes_per_s": bw,
        "weight_bytes_over_bandwidth_s": floor_s,
        "step_over_floor": step_s / floor_s,
        "forward_over_floor": forward_s / floor_s if forward_s else None,
    }


def report_floor(s: dict) -> None:
    fwd = (f", target forward alone {1e3 * s['decode_forward_s']:.2f} ms ({s['forward_over_floor']:.2f}x)"
           if s["decode_forward_s"] else "")
    print(f"\ndecode step, batch 1, no speculation: {1e3 * s['decode_step_s']:.2f} ms per step{fwd}\n"
          f"  floor: {s['weight_bytes'] / 1e6:.1f} MB of target weights / {s['copy_bandwidth_bytes_per_s'] / 1e9:.1f}"
          f" GB/s copy bandwidth (read + write) = {1e3 * s['weight_bytes_over_bandwidth_s']:.2f} ms; "
          f"step / floor = {s['step_over_floor']:.2f}x")
