"""``specserve bench compare``'s runs of the engine modes: all of a mode's prompt groups through its engine
(``engine_run``), or the modes stepping in turn (``engine_lockstep``, ``--lockstep``), with each run's engine
statistics collected into its row."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.compare_report import ALL_CORES_MODE, ALWAYS_MODE, PROCESS_MODE, Row
from engine import SamplingParams

# Modes with a draft thread or process that works on between the engine's steps, or that change the process's
# torch threads: timed by their own steps beside others, they would be credited with work done during others'.
NOT_LOCKSTEP = ("specserve_pipelined", ALL_CORES_MODE, PROCESS_MODE, ALWAYS_MODE)


def _params(group: list[list[int]], i: int, max_tokens: int, temperature: float,
            seeded: bool) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                           seed=1000 * i + j if seeded else None) for j in range(len(group))]


def add_group(engine: Any, group: list[list[int]], params: list[SamplingParams], prefix: str = "") -> None:
    """A prompt group's requests into an engine, named ``prefix`` + their index in the group."""
    for j, (p, sp) in enumerate(zip(group, params, strict=True)):
        engine.add_request(f"{prefix}{j}", p, sp)


def _collect_stats(llm: Any, row: Row) -> None:
    eng = llm.engine
    row.breakdown = eng.times.as_dict()
    row.pipeline = ({**eng.pipeline.stats.as_dict(), "switch": eng.pipeline.switch.as_dict()}
                    if eng.pipeline is not None else None)
    if eng.config.speculative is not None:
        s = eng.stats.as_dict()
        row.acceptance_length.append(s["mean_acceptance_length"])
        drafted = s.get("drafted_tokens") or 0
        row.acceptance_rate.append(s.get("accepted_tokens", 0) / drafted if drafted else 0.0)
        row.chosen_depths, row.mean_chosen_depth = s["chosen_depths"], s["mean_chosen_depth"]


def engine_run(llm: Any, groups: list[list[list[int]]], max_tokens: int, temperature: float,
               row: Row | None, seeded: bool = True) -> list[list[int]]:
    """All groups through the engine, one generate call each; statistics of this run go into ``row``.
    ``seeded``: fixed seeds per request (reproducible; the adaptive policy keeps seeded sampled requests at the
    configured depth, so compare it unseeded)."""
    llm.engine.reset_stats()
    outs = []
    for i, group in enumerate(groups):
        outs += [o.token_ids for o in llm.generate(group, _params(group, i, max_tokens, temperature, seeded))]
    if row is not None:
        _collect_stats(llm, row)
    return outs


def engine_lockstep(llms: dict[str, Any], groups: list[list[list[int]]], max_tokens: int, temperature: float,
                    rows: dict[str, Row], seeded: bool = True) -> dict[str, list[list[int]]]:
    """``--lockstep``: every mode's engine takes one step in turn (the order rotating each turn) until all of a
    group's requests finish in all of them, then the next group. Each mode's row gets the wall and CPU seconds of
    its own steps only, so a drift of the machine's speed over the run (on the 2-core machine no speculation ran
    68 then 85 tok/s in two served repeats a minute apart) falls on every mode alike; the modes' runs interleaved
    whole (``--repeats``) are minutes apart at batch 64. Only modes that do nothing between their steps can run so
    (no draft thread or process working on while another mode steps)."""
    outs: dict[str, list[list[int]]] = {m: [] for m in llms}
    wall = dict.fromkeys(llms, 0.0)
    cpu = dict.fromkeys(llms, 0.0)
    for llm in llms.values():
        llm.engine.reset_stats()
    for i, group in enumerate(groups):
        params = _params(group, i, max_tokens, temperature, seeded)
        done: dict[str, dict[str, list[int]]] = {m: {} for m in llms}
        for llm in llms.values():
            add_group(llm.engine, group, params)
        order, turn = list(llms), 0
        while any(llm.engine.has_unfinished for llm in llms.values()):
            for m in order[turn % len(order):] + order[:turn % len(order)]:
                eng = llms[m].engine
                if not eng.has_unfinished:
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                finished = eng.step_finished()
                wall[m] += time.perf_counter() - t0
                cpu[m] += time.process_time() - c0
                done[m].update((o.request_id, o.token_ids) for o in finished)
            turn += 1
        for m in llms:
            outs[m] += [done[m][str(j)] for j in range(len(group))]
    for m, llm in llms.items():
        rows[m].seconds.append(wall[m])
        rows[m].cpu_seconds.append(cpu[m])
        _collect_stats(llm, rows[m])
    return outs
