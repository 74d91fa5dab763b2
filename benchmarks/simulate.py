"""``specserve bench simulate``: would pipelined speculation pay on a cluster? Replay measured acceptance traces.

    specserve bench simulate record --mode pipelined --temperature 0 --batch 1 --out runs/pipe_t0_b1.jsonl
    specserve bench simulate record --mode chain --temperature 0 --batch 1 --out runs/chain_t0_b1.jsonl
    specserve bench simulate calibrate --chain runs/chain_t0_b1.jsonl --pipelined runs/pipe_t0_b1.jsonl
    specserve bench simulate replay runs/pipe_t0_b1.jsonl [more traces] --costs gpu

``record`` runs the engine and writes a trace (benchmarks/trace.py): per step, each round's accepted
length and whether its tree was pre-drafted. ``calibrate`` fits the CPU cost model from a chain and a pipelined
trace of the same run and compares simulated to measured tokens/s. ``replay`` prints sequential vs pipelined
tokens/s, the "draft fully hidden" bound and the hit rate needed to break even, under named cost models
(benchmarks/sim_model.py has the formulas; ``GPU_COSTS`` below says where each number comes from).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.sim_model import CostModel, hits_by_accepted, replay
from benchmarks.trace import Step, TraceDrafter, read_trace

# Published-shape costs, not measurements: Llama-3.1-70B (bf16, 141 GB) at TP 8 on H100 SXM (3.35 TB/s) verifies
# a few tokens at batch <= 8 at its weight-streaming floor, 141e9 / 8 / 3.35e12 = 5.3 ms, plus all-reduces and
# launches: ~8 ms, in line with vLLM's reported ~8-10 ms TPOT for 70B TP 8 at low load. The draft, Llama-3.2-1B
# (2.5 GB) on its own H100: floor 0.75 ms a forward, ~1.5 ms with launch overhead under CUDA graphs. Two
# pre-drafted outcomes are one batched forward per level while memory-bound, so a pre-draft level costs a draft
# level. Controller <-> worker hops over zmq/Ray on one node: ~0.2 ms each. Separate GPUs: the pre-draft does not
# slow the verify.
GPU_COSTS = {
    "gpu": CostModel("gpu", draft_fixed_ms=0.3, draft_ms_per_level=1.5, verify_fixed_ms=8.0, verify_ms_per_token=0.01,
                     predraft_ms_per_level=1.5, msg_ms=0.2, state_ms=0.5, overlap_slowdown=0.0, hit_propose_ms=0.0,
                     source="roofline: 70B TP8 H100 verify ~8 ms, 1B draft ~1.5 ms/level, 0.2 ms hops"),
    "gpu-slow-link": CostModel("gpu-slow-link", draft_fixed_ms=0.3, draft_ms_per_level=1.5, verify_fixed_ms=8.0,
                               verify_ms_per_token=0.01, predraft_ms_per_level=1.5, msg_ms=1.0, state_ms=0.5,
                               source="as gpu, the draft on another node: 1 ms hops"),
    "gpu-big-draft": CostModel("gpu-big-draft", draft_fixed_ms=0.3, draft_ms_per_level=3.0, verify_fixed_ms=8.0,
                               verify_ms_per_token=0.01, predraft_ms_per_level=3.0, msg_ms=0.2, state_ms=0.5,
                               source="as gpu, an 8B draft on one H100: 16 GB / 3.35 TB/s + launches ~3 ms"),
}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def _spec_steps(steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.prefill_tokens == 0 and any(r.drafted for r in s.rounds)]


def fit_cpu(chain: list[Step], chain_summary: dict, pipe: list[Step], pipe_summary: dict) -> CostModel:
    """This machine's costs, from a chain run (draft and verify apart) and a pipelined run (side by side).

    The overlapped phase is fitted as measured, verify wall + the wait for the pre-draft after it: the mean of
    a per-step max(verify, pre-draft) is above the max of their means when both vary (they do, on a shared
    CPU), and a constant-cost model would miss that. A miss's re-draft is fitted apart from the chain's draft.
    """
    cs, ps = _spec_steps(chain), _spec_steps(pipe)
    depth = max(r.drafted for s in cs for r in s.rounds)
    verify_alone = _mean([s.verify_s for s in cs])
    verify_beside = _mean([s.verify_wall_s + s.collect_s for s in ps if s.predraft_s > 0])
    hit = [all(r.hit for r in s.rounds if r.drafted) for s in ps]
    all_hit = [s.propose_s for s, h in zip(ps, hit, strict=True) if h]
    missed = [s.propose_s for s, h in zip(ps, hit, strict=True) if not h]
    state = (chain_summary["wall_s"] - sum(s.step_s for s in chain)) / max(1, len(chain))
    return CostModel(
        "cpu", draft_fixed_ms=0.0, draft_ms_per_level=1e3 * _mean([s.propose_s for s in cs]) / depth,
        verify_fixed_ms=1e3 * verify_alone, verify_ms_per_token=0.0,
        predraft_ms_per_level=1e3 * _mean([s.predraft_s for s in ps if s.predraft_s > 0]) / (depth + 1),
        msg_ms=1e3 * max(0.0, _mean([s.verify_wall_s - s.verify_s for s in cs])) / 2, state_ms=1e3 * max(0.0, state),
        overlap_slowdown=max(0.0, verify_beside / verify_alone - 1) if verify_alone else 0.0,
        hit_propose_ms=1e3 * _mean(all_hit), redraft_ms_per_level=1e3 * _mean(missed) / depth,
        source="fitted from the chain and pipelined traces")


def record(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.compare import load_prompts
    from engine import LLM, SamplingParams
    from engine.core.config import DEFAULT_MODELS_DIR, default_model_dirs
    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    torch.set_num_threads(args.threads)
    target, draft = default_model_dirs()
    cfg = ModelConfig.from_pretrained(target)
    prompts = load_prompts(str(DEFAULT_MODELS_DIR / "prompts.jsonl"), load_tokenizer(target), cfg.vocab_size,
                           max(args.num_prompts, args.batch), cfg.max_model_len - args.max_tokens - args.k - 2)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k, "adaptive": False,
            "pipeline": args.mode == "pipelined", "pipeline_width": args.width,
            "pipeline_switch": False}  # a pipelined trace: every step pipelined
    if args.draft_process:  # the draft in its own process, one core per role (engine/execution/draft_process.py)
        from benchmarks.compare import one_core_per_role

        spec.update(draft_process=True, **one_core_per_role())
    llm = LLM(target, spec, dtype="float32", max_num_seqs=args.batch,
              num_kv_tokens=args.batch * (max(len(p) for p in prompts) + args.max_tokens + 64))
    groups = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]

    def run(gs: list[list[list[int]]], n: int) -> int:
        done = 0
        for i, g in enumerate(gs):
            params = [SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True, seed=1000 * i + j)
                      for j in range(len(g))]
            done += sum(len(o.token_ids) for o in llm.generate(g, params))
        return done

    try:
        run(groups[:1], 2)  # warm-up: the first use of a batch shape allocates
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(json.dumps({"kind": "header", **{k: v for k, v in vars(args).items() if k != "func"}}) + "\n")
            eng = llm.engine
            inner, eng.drafter = eng.drafter, TraceDrafter(eng.drafter, f)
            t0 = time.perf_counter()
            tokens = run(groups, args.max_tokens)
            wall = time.perf_counter() - t0
            eng.drafter = inner
            f.write(json.dumps({"kind": "summary", "wall_s": wall, "tokens": tokens}) + "\n")
    finally:
        llm.shutdown()
    print(f"{args.mode} T={args.temperature} batch={args.batch}: {tokens / wall:.1f} tok/s -> {args.out}")
    return 0


def _summary(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line) if line.strip() else {}
            if d.get("kind") == "summary":
                return d
    raise ValueError(f"{path}: no summary line (an unfinished recording?)")


def calibrate(args: argparse.Namespace) -> int:
    (_, chain), (_, pipe) = read_trace(args.chain), read_trace(args.pipelined)
    cs, ps = _summary(args.chain), _summary(args.pipelined)
    if args.costs:  # a held-out check: another run's fitted costs, on this run's traces
        with open(args.costs, encoding="utf-8") as f:
            d = json.load(f)
        c = CostModel(**d.get("cost_model", d))
    else:
        c = fit_cpu(chain, cs, pipe, ps)
    print(f"fitted: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in c.__dict__.items()})}")
    sim_chain, sim_pipe = replay(chain, c).sequential_tok_s, replay(pipe, c).pipelined_tok_s
    meas_chain, meas_pipe = cs["tokens"] / cs["wall_s"], ps["tokens"] / ps["wall_s"]
    print(f"{'':<10} {'measured':>9} {'simulated':>9} {'gap':>6}")
    for name, m, s in (("chain", meas_chain, sim_chain), ("pipelined", meas_pipe, sim_pipe)):
        print(f"{name:<10} {m:>9.1f} {s:>9.1f} {100 * (s / m - 1):>5.1f}%")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cost_model": c.__dict__, "measured": {"chain": meas_chain, "pipelined": meas_pipe},
                       "simulated": {"chain": sim_chain, "pipelined": sim_pipe}}, f, indent=1)
    return 0


def print_hits(traces: list[str]) -> None:
    print("\nhit rate of round r+1 by round r's accepted length (hits/rounds):")
    for path in traces:
        header, steps = read_trace(path)
        by = hits_by_accepted(steps)
        cells = "  ".join(f"{j}: {h}/{n}" for j, (h, n) in by.items())
        print(f"  T={header.get('temperature')} b={header.get('batch')} {os.path.basename(path)}: {cells or '-'}")


def print_table(traces: list[str], models: list[CostModel]) -> None:
    for c in models:
        numbers = {k: v for k, v in c.__dict__.items() if k not in ("name", "source")}
        print(f"\ncost model {c.name}: {c.source}\n  {json.dumps(numbers)}")
        print(f"  {'trace':<28} {'hit':>5} {'seq tok/s':>9} {'pipe tok/s':>10} {'ratio':>6} {'hidden':>6} "
              f"{'break-even hit':>14} {'no-wait':>7}")
        for path in traces:
            header, steps = read_trace(path)
            r = replay(steps, c)
            name = f"T={header.get('temperature')} b={header.get('batch')} {os.path.basename(path)}"
            be = "never" if r.break_even is None else f"{r.break_even:.2f}"
            print(f"  {name[:28]:<28} {r.hit_rate:>5.2f} {r.sequential_tok_s:>9.1f} {r.pipelined_tok_s:>10.1f} "
                  f"{r.pipelined_tok_s / r.sequential_tok_s:>5.2f}x {r.hidden_tok_s / r.sequential_tok_s:>5.2f}x "
                  f"{be:>14} {r.nowait_tok_s / r.sequential_tok_s:>6.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench simulate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the engine, write an acceptance trace")
    r.add_argument("--mode", choices=["chain", "pipelined"], default="pipelined")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--num-prompts", type=int, default=8)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--k", type=int, default=4)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--width", type=int, default=2, help="pipeline_width: predicted outcomes pre-drafted a round")
    r.add_argument("--draft-process", action="store_true", help="the draft in its own process, one core per role")
    r.add_argument("--out", required=True)
    r.set_defaults(func=record)
    c = sub.add_parser("calibrate", help="fit this machine's costs, simulated vs measured")
    c.add_argument("--chain", required=True)
    c.add_argument("--pipelined", required=True)
    c.add_argument("--json", default=None, help="write the fitted cost model and the comparison here")
    c.add_argument("--costs", default=None, help="do not fit: use this cost model (calibrate --json of another run)")
    c.set_defaults(func=calibrate)
    p = sub.add_parser("replay", help="sequential vs pipelined under cost models")
    p.add_argument("traces", nargs="+")
    p.add_argument("--costs", default="gpu", help=f"comma-separated: {', '.join(GPU_COSTS)}, or a JSON file of "
                   "CostModel fields (e.g. calibrate --json's cost_model)")
    p.set_defaults(func=lambda a: _replay(a))
    args = ap.parse_args(argv)
    return args.func(args)


def _replay(args: argparse.Namespace) -> int:
    models = []
    for name in args.costs.split(","):
        if name in GPU_COSTS:
            models.append(GPU_COSTS[name])
        else:
            with open(name, encoding="utf-8") as f:
                d = json.load(f)
            models.append(CostModel(**d.get("cost_model", d)))
    print_table(args.traces, models)
    print_hits(args.traces)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
