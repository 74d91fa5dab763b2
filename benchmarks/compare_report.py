"""``specserve bench compare``'s rows and their report: the modes, a mode's measurements over repeats (``Row``),
the ratios between modes (``summarize``) and the printed table (``report``), with where each row's time went."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any

ENGINE_MODES = ("specserve_nospec", "specserve_chain", "specserve_tree", "specserve_pipelined", "specserve_adaptive",
                "specserve_adaptive_tree",
                "specserve_chain_allcores", "specserve_pipelined_process", "specserve_pipelined_process_always")
# Equal hardware (issue 18): the sequential chain whose every phase may use all of this process's cores (torch
# threads = cores) against pipelining with the draft in its own process, one core per role (draft on the last
# core, target on the first). specserve_chain / specserve_pipelined keep --threads and the in-process draft thread.
# Pipelined modes switch each step to sequential where that measures cheaper (engine/drafting/pipeline_switch.py; a
# sequential step's target runs on both roles' cores); "_always" pipelines every step.
ALL_CORES_MODE, PROCESS_MODE = "specserve_chain_allcores", "specserve_pipelined_process"
ALWAYS_MODE = "specserve_pipelined_process_always"
FIXED_K_MODE = "specserve_k"  # + K: a fixed chain of K per --fixed-ks
HF_MODES = ("hf_generate", "hf_assisted", "hf_assisted_constant_k")  # the assisted ones at batch 1 only


@dataclass
class Row:
    mode: str
    temperature: float
    batch: int
    tokens: int = 0  # per repeat
    seconds: list[float] = field(default_factory=list)  # one per repeat
    # This process's CPU seconds per repeat (all its threads): on a machine shared with other work the wall time
    # swings 3x within minutes, the CPU time much less (the engine's CPU path is one thread at a time).
    cpu_seconds: list[float] = field(default_factory=list)
    acceptance_length: list[float] = field(default_factory=list)
    acceptance_rate: list[float] = field(default_factory=list)
    breakdown: dict | None = None  # the engine's StepTimes of the last repeat
    pipeline: dict | None = None
    greedy_match_vs_hf: str | None = None
    chosen_depths: dict | None = None  # rounds per depth the speculation policy chose (last repeat)
    mean_chosen_depth: float | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def tok_cpu_s(self) -> float:
        return self.tokens / statistics.median(self.cpu_seconds) if self.cpu_seconds else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "outputs"}
        return {**d, "tok_s": self.tok_s, "tok_cpu_s": self.tok_cpu_s, "cycle_model": cycle_model(self),
                "draft_hidden_bound_tok_s":
                hidden_bound(self) if self.mode in ("specserve_chain", ALL_CORES_MODE) else None}


def hidden_bound(r: Row) -> float | None:
    """Tokens/s of a sequential row if its drafting were fully hidden: its measured wall time less its draft
    time (draft calls and their collection), everything else (verify, state, scheduling) as measured."""
    b = r.breakdown
    if not b or not b.get("steps") or not r.tokens or not r.seconds:
        return None
    draft = b.get("draft_wall_s", 0.0) + b.get("collect_s", 0.0)
    rest = r.seconds[-1] - draft
    return r.tokens / rest if rest > 0 else None


def cycle_model(r: Row) -> dict | None:
    """Predicted seconds per token from the engine's breakdown vs the measured wall time per token."""
    b = r.breakdown
    if not b or not b.get("steps") or not r.tokens:
        return None
    draft = b.get("draft_wall_s", 0.0) + b.get("collect_s", 0.0)
    verify = b.get("verify_wall_s", 0.0)
    state = b.get("commit_s", 0.0) + b.get("schedule_s", 0.0)
    return {"draft_s_per_tok": draft / r.tokens, "verify_s_per_tok": verify / r.tokens,
            "state_s_per_tok": state / r.tokens, "model_s_per_tok": (draft + verify + state) / r.tokens,
            "measured_s_per_tok": r.seconds[-1] / r.tokens}

def summarize(rows: list[Row], k: int) -> dict:
    """Ratios per (temperature, batch): each mode against the chain, HF assisted and HF generate."""
    out: dict[str, Any] = {}
    for r in rows:
        by = {x.mode: x for x in rows if (x.temperature, x.batch) == (r.temperature, r.batch)}
        key = f"T={r.temperature}@{r.batch}:{r.mode}"
        for base in ("specserve_chain", ALL_CORES_MODE, "specserve_nospec", "hf_assisted", "hf_generate"):
            b = by.get(base)
            if b is not None and b is not r and b.tok_s:
                out[f"{key}_vs_{base}"] = r.tok_s / b.tok_s
        if r.acceptance_length:
            out[f"{key}_mean_acceptance_length"] = statistics.median(r.acceptance_length)
        if r.mode in ("specserve_chain", ALL_CORES_MODE) and hidden_bound(r):
            out[f"{key}_draft_hidden_bound_tok_s"] = hidden_bound(r)
    out["k"] = k
    return out


def paired(r: Row, base: Row) -> str:
    """`` [per repeat a, b, c: median m]``: ``r``'s tokens per CPU-second over ``base``'s within each repeat (run
    next to each other), or "" with fewer than two repeats. The ratio of the medians mixes the machine's speeds:
    on the 2-core machine one repeat ran the fixed chain at 79 and the next at 108 tok/s, and each repeat's
    modes ran at about one speed."""
    if len(r.cpu_seconds) < 2 or len(r.cpu_seconds) != len(base.cpu_seconds) or not r.tokens or not base.tokens:
        return ""
    ratios = [(r.tokens / a) / (base.tokens / b) for a, b in zip(r.cpu_seconds, base.cpu_seconds, strict=True)]
    return f" [per repeat {', '.join(f'{x:.2f}' for x in ratios)}: median {statistics.median(ratios):.2f}]"


def report(args: argparse.Namespace, rows: list[Row], summary: dict) -> None:
    print(f"\ntarget {args.target}\ndraft  {args.draft}\n{args.num_prompts} prompts, {args.max_tokens} tokens each, "
          f"chain K={args.k}, tree {args.tree}, dtype {args.dtype}, {args.threads} thread(s), median of "
          f"{args.repeats} repeat(s)"
          f"{' (engine modes in lockstep: each timed by its own steps, taken in turn)' if args.lockstep else ''}\n")
    print(f"{'T':>4} {'batch':>5} {'mode':<28} {'tok/s':>8} {'acc.len':>7} {'acc.rate':>8} {'K mean':>6} "
          f"{'vs chain':>8} {'vs nospec':>9} {'vs HF-asst':>10} {'vs HF-gen':>9} {'greedy=HF':>9}")
    for r in rows:
        key = f"T={r.temperature}@{r.batch}:{r.mode}"

        def ratio(base: str, key: str = key) -> str:
            v = summary.get(f"{key}_vs_{base}")
            return f"{v:.2f}x" if v is not None else "-"

        acc = f"{statistics.median(r.acceptance_length):.2f}" if r.acceptance_length else "-"
        rate = f"{statistics.median(r.acceptance_rate):.2f}" if r.acceptance_rate else "-"
        kmean = f"{r.mean_chosen_depth:.2f}" if r.mean_chosen_depth is not None else "-"
        print(f"{r.temperature:>4} {r.batch:>5} {r.mode:<28} {r.tok_s:>8.1f} {acc:>7} {rate:>8} {kmean:>6} "
              f"{ratio('specserve_chain'):>8} {ratio('specserve_nospec'):>9} {ratio('hf_assisted'):>10} "
              f"{ratio('hf_generate'):>9} {r.greedy_match_vs_hf or '-':>9}")
    pairs = [(r, x) for r in rows if r.mode in (PROCESS_MODE, ALWAYS_MODE) for x in rows
             if x.mode == ALL_CORES_MODE and (x.temperature, x.batch) == (r.temperature, r.batch)]
    if pairs:
        print("\nequal hardware: pipelined, draft in its own process, one core per role vs the sequential chain on "
              "all cores\n(bound: the chain's own run with its draft time removed = draft fully hidden)")
        for r, x in pairs:
            bound = hidden_bound(x)
            pipe = r.pipeline or {}
            print(f"  T={r.temperature} b={r.batch} {r.mode}: pipelined {r.tok_s:.1f} vs chain {x.tok_s:.1f} tok/s"
                  f" = {r.tok_s / x.tok_s:.2f}x; draft fully hidden {bound or 0:.1f} tok/s "
                  f"({(bound or 0) / x.tok_s:.2f}x); hit rate {pipe.get('hit_rate', 0):.2f}, outcomes per round "
                  f"{pipe.get('outcomes_per_round', 0):.2f}; steps pipelined {pipe.get('pipelined_fraction', 0):.2f}"
                  f" (last repeat)")
            for key, g in (pipe.get("switch") or {}).items():
                print(f"      switch {key}: {g['mode']}, ms per token pipelined {g['pipelined_ms_per_token']} vs "
                      f"sequential {g['sequential_ms_per_token']}, {g['switches']} switch(es)")
            for what in ("position", "temperature"):
                table = pipe.get(f"hit_rate_by_{what}") or {}
                print(f"      hit rate by {what}: " + ", ".join(
                    f"{k}: {v['hit_rate']:.2f} ({v['rounds']})" for k, v in table.items()))
    print("\ntokens per CPU-second of this process (median of repeats; steadier than tok/s on a shared machine):")
    for r in rows:
        same = [x for x in rows if (x.temperature, x.batch) == (r.temperature, r.batch) and x.tok_cpu_s]
        base = next((x for x in same if x.mode == "specserve_nospec"), None)
        fixed = [x for x in same if x.mode.startswith(FIXED_K_MODE) or x.mode == "specserve_chain"]
        best = max(fixed, key=lambda x: x.tok_cpu_s, default=None)
        adaptive = r.mode.startswith("specserve_adaptive")
        vs = ""
        if base is not None and base is not r:
            vs = f"  {r.tok_cpu_s / base.tok_cpu_s:.2f}x nospec{paired(r, base) if adaptive else ''}"
        if best is not None and adaptive:
            vs += f"  {r.tok_cpu_s / best.tok_cpu_s:.2f}x best fixed K ({best.mode}){paired(r, best)}"
        print(f"  T={r.temperature} b={r.batch:<3} {r.mode:<24} {r.tok_cpu_s:8.1f}{vs}")
    adaptive = [r for r in rows if r.mode.startswith("specserve_adaptive") and r.chosen_depths]
    if adaptive:
        print("\nK chosen by the adaptive policy (rounds per depth, last repeat; plain-decode rounds are '0'):")
        for r in adaptive:
            print(f"  T={r.temperature} b={r.batch} {r.mode}: {r.chosen_depths}")
    print("\nwhere the engine's time goes (ms per output token, last repeat; model = draft + verify + state):")
    for r in rows:
        c = cycle_model(r)
        if c:
            print(f"  T={r.temperature} b={r.batch} {r.mode:<22} draft {1e3 * c['draft_s_per_tok']:.2f}  verify "
                  f"{1e3 * c['verify_s_per_tok']:.2f}  state {1e3 * c['state_s_per_tok']:.2f}  model "
                  f"{1e3 * c['model_s_per_tok']:.2f}  measured {1e3 * c['measured_s_per_tok']:.2f}"
                  + (f"  pipeline {r.pipeline}" if r.pipeline else ""))
