"""``specserve bench compare``: every decoding mode side by side, on the same prompts with the same settings.

Modes: transformers ``generate``; transformers assisted generation (``assistant_model``, batch 1 as transformers
supports it; with its default schedule, and with K constant to match ours); specserve without speculation, with
a chain of K, with a tree at the same verification budget (nodes verified per round), and the chain pipelined.

For each temperature and batch size (the prompts run in groups of that size): output tokens/s, the median over
``--repeats`` with the modes interleaved within each repeat (in rotating order) and warm-up runs excluded; mean
acceptance length (tokens per verify round, the bonus/recovered token included) and acceptance rate (accepted /
drafted); ratios
against the chain, HF assisted and HF generate; at temperature 0, how many outputs equal HF generate's token for
token (every mode generates exactly ``--max-tokens`` tokens; a near-tie can flip an argmax between differently
ordered float sums, so a rare mismatch after many tokens is numerics, not a bug); and where the engine's time
goes per output token against the cycle-cost model: (draft + verify + state) / tokens. Once, at batch 1: the
engine's decode step and the bare target forward against the memory floor (benchmarks/floor.py).

On CPU the default models' fp16 weights run in float32 (``--dtype``): half-precision matmuls have no fast path
on CPUs without AVX512-FP16, for transformers as for us.

    specserve bench compare --json runs/compare.json
    specserve bench compare --num-prompts 2 --max-tokens 16 --repeats 1      # a quick smoke run
    specserve bench compare --batches 64 --num-prompts 64 --modes specserve_nospec,specserve_adaptive \
        --skip-hf --skip-floor --unseeded --lockstep     # saturation, the modes step by step in turn
    specserve bench compare --target smollm2 --quantization none --draft smollm2 --draft-quantization gguf \
        --batches 1 --temperatures 0 --skip-hf    # a GGUF target, its own 4-bit copy drafting
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.compare_report import (
    ALL_CORES_MODE,
    ALWAYS_MODE,
    ENGINE_MODES,
    FIXED_K_MODE,
    HF_MODES,
    PROCESS_MODE,
    Row,
    report,
    summarize,
)
from benchmarks.engine_runs import NOT_LOCKSTEP, engine_lockstep, engine_run
from benchmarks.floor import measure_floor, report_floor
from engine import LLM, SamplingParams
from engine.core.config import DEFAULT_MODELS_DIR, default_model_dirs
from engine.drafting.eagle import shipped_head

# EAGLE heads (engine/drafting/eagle.py): opt-in modes, named in --modes.
EAGLE_MODES = ("specserve_eagle", "specserve_eagle_tree")

# Draftless modes (engine/drafting/): prompt lookup and suffix decoding, run only when --modes names them.
DRAFTLESS_MODES = ("specserve_ngram", "specserve_suffix")
# the target's own early layers draft a chain of --k; _tree: a tree of --layer-skip-tree branching
LAYER_SKIP_MODES = ("specserve_layer_skip", "specserve_layer_skip_tree")


def load_prompts(path: str | None, tokenizer: Any, vocab: int, n: int, max_len: int) -> list[list[int]]:
    """Token ids of ``n`` prompts no longer than ``max_len`` (reused when the file has fewer); random ids when
    there is no prompt file, or none of its prompts fits this model: a model without a tokenizer (the random
    pair, every test checkpoint) takes a file's token-id prompts only, and only those inside its vocabulary."""
    out: list[list[int]] = []
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if "prompt_token_ids" in r:
                        ids = r["prompt_token_ids"]
                    elif tokenizer is not None:
                        ids = tokenizer.encode(r["prompt"])
                    else:
                        continue
                    if 0 < len(ids) <= max_len and max(ids) < vocab:
                        out.append(list(ids))
    if not out:
        gen = torch.Generator().manual_seed(0)
        out = [torch.randint(1, vocab, (32,), generator=gen).tolist() for _ in range(n)]
    while len(out) < n:
        out += out[: n - len(out)]
    return out[:n]


class HF:
    """transformers ``generate`` on the target, optionally assisted by the draft; EOS never stops it."""

    def __init__(self, target: str, draft: str, dtype: torch.dtype, device: str, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        def load(path: str) -> Any:  # a checkpoint directory, or a GGUF file transformers dequantizes
            kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
            src = os.path.dirname(path) if kw else path
            return AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).to(device).eval()

        self.model, self.draft = load(target), load(draft)
        self.draft = full_vocab_view(self.draft, draft)
        for m in (self.model, self.draft):
            m.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
            m.generation_config.pad_token_id = pad_id
        self.pad_id, self.device = pad_id, device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int,
                 assisted: bool = False, k: int | None = None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)  # left pad
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens}
        if SamplingParams(temperature=temperature).greedy:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        if assisted:
            kw["assistant_model"] = self.draft
            if k is not None:
                kw.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0)
        return self.model.generate(ids, attention_mask=mask, **kw)[:, width:].tolist()


def full_vocab_view(model: Any, path: str) -> Any:
    """A draft with a trimmed vocabulary (``draft_vocab_map.json``) as transformers' assisted generation needs it:
    full-vocabulary ids in, full-vocabulary logits out, ``-inf`` off the map (the law the engine's draft worker
    proposes from, workers/vocab_map.py); any other model unchanged."""
    from workers.vocab_map import DraftVocabMap

    vmap = DraftVocabMap.load(path)
    if vmap is None:
        return model
    base_forward = model.forward

    def forward(input_ids: torch.Tensor | None = None, **kw: Any) -> Any:
        out = base_forward(input_ids=None if input_ids is None else vmap.local.to(input_ids.device)[input_ids], **kw)
        lead = out.logits.shape[:-1]
        out.logits = vmap.to_full(out.logits.reshape(-1, vmap.size)).reshape(*lead, -1)  # [B, L, Vt]
        return out

    model.forward = forward
    model.config.vocab_size = vmap.target_vocab_size  # what assisted generation compares with the target's
    return model


def one_core_per_role() -> dict:
    """Draft on the last core this process may use, target on the first (nothing pinned on a 1-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return {"draft_cores": [cores[-1]], "target_cores": [cores[0]]} if len(cores) > 1 else {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specserve bench compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="default: the built-in target")
    ap.add_argument("--draft", default=None, help="default: the built-in draft")
    ap.add_argument("--random-shape", default=None, metavar="HIDDEN,LAYERS,VOCAB",
                    help="a random target of this shape (e.g. 1024,12,32000) and its first layer as the draft, "
                         "built under --random-dir (timing only; benchmarks/random_pair.py)")
    ap.add_argument("--random-dir", default=os.path.join("runs", "random-pair"))
    ap.add_argument("--prompts", default=str(DEFAULT_MODELS_DIR / "prompts.jsonl"),
                    help="JSONL with 'prompt' or 'prompt_token_ids' (random prompts when the file is missing)")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per run (reused to fill a larger batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="chain length")
    ap.add_argument("--tree", default="2,1", help="tree branching at the chain's node budget (2,1: 4 nodes)")
    ap.add_argument("--adaptive-k", type=int, default=8, help="K_max of specserve_adaptive")
    ap.add_argument("--draftless-k", type=int, default=10, help="num_speculative_tokens of specserve_ngram / _suffix")
    ap.add_argument("--draftless-fallback", action="store_true",
                    help="specserve_ngram / _suffix draft with the chain's draft model where they find no match")
    ap.add_argument("--suffix-cross-request", action="store_true",
                    help="specserve_suffix keeps its cache of finished outputs; off by default: the repeats run the "
                         "same prompts, and the cache would replay their earlier outputs")
    ap.add_argument("--adaptive-tree", default="",
                    help="the configured tree of specserve_adaptive_tree, whose menu per request is chains 1 .. its "
                         "depth and this tree (default: 2 then 1s to --adaptive-k)")
    ap.add_argument("--pipeline-width", type=int, default=2, help="most outcomes pre-drafted per request per round "
                    "(pipelined modes; how many within it is chosen by expected value)")
    ap.add_argument("--fixed-ks", default="", help="also fixed chains of these K (modes specserve_k<K>), "
                                                   "e.g. 2,4,6,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--unseeded", action="store_true",
                    help="sampled requests without seeds (seeded ones keep the configured depth under adaptive)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (the tables show medians)")
    ap.add_argument("--lockstep", action="store_true",
                    help="the engine modes step in turn, one step each, and each is timed by its own steps (the "
                         "machine's drift falls on all alike); the pipelined, all-cores and HF modes still run "
                         "alone")
    ap.add_argument("--modes", default=",".join(HF_MODES + ENGINE_MODES), help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    ap.add_argument("--dtype", default="float32", help="compute dtype for transformers and specserve")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", choices=["uni", "ray"], default=None, help="specserve's executor")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers modes")
    ap.add_argument("--skip-floor", action="store_true", help="no decode-step vs memory-floor measurement")
    ap.add_argument("--quantization", choices=["gguf", "none"], default=None, help="a GGUF target's weights")
    ap.add_argument("--draft-quantization", choices=["gguf", "none"], default=None, help="a GGUF draft's weights")
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--eagle-head", default=None,
                    help="EAGLE head of the eagle modes (specserve_eagle: a chain of --k; specserve_eagle_tree: a "
                         "dynamic tree of --eagle-nodes nodes, depth --k); default: the built-in target's shipped head")
    ap.add_argument("--eagle-nodes", type=int, default=8, help="node budget of specserve_eagle_tree")
    ap.add_argument("--exit-layer", type=int, default=None,
                    help="specserve_layer_skip's exit layer (default: the target's shipped exit adapter and its L)")
    ap.add_argument("--exit-adapter", default=None, help="specserve_layer_skip's exit adapter directory")
    ap.add_argument("--layer-skip-tree", default="2,2,1,1", help="specserve_layer_skip_tree's branching")
    ap.add_argument("--exit-layers", default="", help="also adapter-free layer_skip at these L (modes "
                                                      "specserve_layer_skip_L<L>), e.g. 10,15,20")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.random_shape:
        from benchmarks.random_pair import make_random_pair, parse_shape

        pair_dir = os.path.join(args.random_dir, args.random_shape.replace(",", "x") + "-accepting")
        args.target, args.draft = make_random_pair(pair_dir, *parse_shape(args.random_shape))
        args.prompts = None  # no tokenizer, another vocabulary: random prompt ids
    if args.target is None or args.draft is None:
        t, d = default_model_dirs()
        args.target, args.draft = args.target or t, args.draft or d
    from workers.gguf_loader import resolve_model_path

    args.target_name = args.target if args.target == "smollm2" else "builtin"  # whose shipped EAGLE head
    args.target, args.draft = resolve_model_path(args.target), resolve_model_path(args.draft)
    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    fixed_ks = [int(x) for x in args.fixed_ks.split(",") if x]
    modes = [m for m in args.modes.split(",") if m and not (args.skip_hf and m.startswith("hf_"))]
    exit_modes = {f"{LAYER_SKIP_MODES[0]}_L{x}": int(x) for x in args.exit_layers.split(",") if x}
    modes += [f"{FIXED_K_MODE}{k}" for k in fixed_ks] + list(exit_modes)
    unknown = sorted(set(modes) - set(HF_MODES + ENGINE_MODES + EAGLE_MODES + DRAFTLESS_MODES + LAYER_SKIP_MODES)
                     - {f"{FIXED_K_MODE}{k}" for k in fixed_ks} - set(exit_modes))
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; known: {list(HF_MODES + ENGINE_MODES)}")
    cfg = ModelConfig.from_pretrained(args.target)
    batches = [int(x) for x in args.batches.split(",") if x]
    temps = [float(x) for x in args.temperatures.split(",") if x]
    tree = [int(x) for x in args.tree.split(",")]
    adaptive_tree = ([int(x) for x in args.adaptive_tree.split(",")] if args.adaptive_tree
                     else [2] + [1] * (args.adaptive_k - 1))
    n = args.max_tokens
    prompts = load_prompts(args.prompts, load_tokenizer(args.target), cfg.vocab_size,
                           max([args.num_prompts, *batches]),
                           cfg.max_model_len - n
                           - max([args.k, args.adaptive_k, len(adaptive_tree), *fixed_ks, args.draftless_k]) - 2)
    kv = max(batches) * (max(len(p) for p in prompts) + n + 64)
    chain = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k, "adaptive": False,
             "quantization": args.draft_quantization}
    specs = {"specserve_nospec": "none", "specserve_chain": chain,
             "specserve_tree": {**chain, "num_speculative_tokens": len(tree), "tree_branching": tree},
             "specserve_pipelined": {**chain, "pipeline": True, "pipeline_width": args.pipeline_width},
             ALL_CORES_MODE: chain,
             PROCESS_MODE: {**chain, "pipeline": True, "pipeline_width": args.pipeline_width, "draft_process": True,
                            **one_core_per_role()},
             ALWAYS_MODE: {**chain, "pipeline": True, "pipeline_width": args.pipeline_width, "draft_process": True,
                           "pipeline_switch": False, **one_core_per_role()},
             "specserve_adaptive": {**chain, "num_speculative_tokens": args.adaptive_k, "adaptive": True},
             "specserve_adaptive_tree": {**chain, "num_speculative_tokens": len(adaptive_tree),
                                         "tree_branching": adaptive_tree, "adaptive": True},
             **{f"{FIXED_K_MODE}{k}": {**chain, "num_speculative_tokens": k} for k in fixed_ks},
             **draftless_specs(args, chain)}
    if any(m in EAGLE_MODES for m in modes):  # beside the separate draft at the same K and verify budget
        head = args.eagle_head or shipped_head(getattr(args, "target_name", "builtin"))
        specs["specserve_eagle"] = {"method": "eagle3", "model": head, "num_speculative_tokens": args.k,
                                    "adaptive": False}
        specs["specserve_eagle_tree"] = {**specs["specserve_eagle"], "num_draft_tokens": args.eagle_nodes}
    specs["specserve_layer_skip"] = {"method": "layer_skip", "num_speculative_tokens": args.k,
                                     **({"exit_layer": args.exit_layer} if args.exit_layer else {}),
                                     **({"model": args.exit_adapter} if args.exit_adapter else {})}
    ls_tree = [int(x) for x in args.layer_skip_tree.split(",")]
    specs["specserve_layer_skip_tree"] = {**specs["specserve_layer_skip"], "num_speculative_tokens": len(ls_tree),
                                          "tree_branching": ls_tree}
    specs.update({m: {"method": "layer_skip", "num_speculative_tokens": args.k, "exit_layer": x}
                  for m, x in exit_modes.items()})
    print(f"loading (dtype {args.dtype}, {args.threads} thread(s)) ...", flush=True)
    hf = None
    if any(m.startswith("hf_") for m in modes) or not args.skip_floor:
        pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        hf = HF(args.target, args.draft, getattr(torch, args.dtype), args.device, pad)
    llms = {m: LLM(args.target, specs[m], dtype=args.dtype, device=args.device, max_num_seqs=max(batches),
                   num_kv_tokens=kv, distributed_executor_backend=args.backend, quantization=args.quantization)
            for m in specs if m in modes or (m == "specserve_nospec" and not args.skip_floor)}
    try:
        rows = run_all(args, modes, hf, llms, prompts, batches, temps)
        floor = None
        if not args.skip_floor:
            floor = measure_floor(llms["specserve_nospec"], hf.model, prompts[: args.num_prompts], n, args.repeats)
    finally:
        for llm in llms.values():
            llm.shutdown()
    summary = summarize(rows, args.k)
    report(args, rows, summary)
    if floor is not None:
        report_floor(floor)
        summary.update(floor)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__},
                       "results": [r.as_dict() for r in rows], "summary": summary}, f, indent=1)
    return 0


def run_all(args: argparse.Namespace, modes: list[str], hf: HF | None, llms: dict[str, Any],
            prompts: list[list[int]], batches: list[int], temps: list[float]) -> list[Row]:
    n = args.max_tokens
    rows: list[Row] = []
    for temp in temps:
        for batch in batches:
            ps = prompts[: max(args.num_prompts, batch)]
            groups = [ps[i: i + batch] for i in range(0, len(ps), batch)]
            runs: dict[str, Callable[[Row | None], list[list[int]]]] = {}
            for m in modes:
                if m.startswith("hf_assisted") and batch != 1:
                    continue  # transformers assists batch 1 only
                if m.startswith("hf_"):
                    def hf_run(row, m=m, g=groups, t=temp):
                        return [o for i, grp in enumerate(g) for o in hf.generate(
                            grp, n, t, 1000 * i, assisted=m != "hf_generate",
                            k=args.k if m == "hf_assisted_constant_k" else None)]
                    runs[m] = hf_run
                elif m == ALL_CORES_MODE:
                    def all_cores_run(row, m=m, g=groups, t=temp):
                        threads = torch.get_num_threads()
                        torch.set_num_threads(len(os.sched_getaffinity(0)))
                        try:
                            return engine_run(llms[m], g, n, t, row)
                        finally:
                            torch.set_num_threads(threads)
                    runs[m] = all_cores_run
                else:
                    runs[m] = lambda row, m=m, g=groups, t=temp: engine_run(llms[m], g, n, t, row, not args.unseeded)
            for m in runs:  # warm-up, untimed: the first use of a batch shape allocates
                if m.startswith("hf_"):
                    hf.generate(groups[0], 2, temp, 0, assisted=m != "hf_generate")
                else:
                    runs[m](None) if m == ALL_CORES_MODE else engine_run(llms[m], groups[:1], 2, temp, None)
            group_rows = {m: Row(m, temp, batch) for m in runs}
            # Units run in turn: each mode alone, or with --lockstep the modes that can all in one unit, step by
            # step (not ``modes``: a group may skip some, HF assisted runs batch 1 only).
            lock = [m for m in runs if args.lockstep and m in llms and m not in NOT_LOCKSTEP]
            units = [[m] for m in runs if m not in lock] + ([lock] if lock else [])
            for rep in range(args.repeats):
                # Rotating order (A B C, B C A, ...): the machine drifts, and a mode's place is not neutral. Run
                # first in every repeat, no speculation measured 0.76-0.83x the adaptive policy at batch 64, T=0.8
                # (larger random pair) while the policy ran plain decode throughout: the same work, which side by
                # side in one process, in turn, measured alike.
                for unit in units[rep % len(units):] + units[:rep % len(units)]:
                    if unit is lock:
                        outs = engine_lockstep({m: llms[m] for m in unit}, groups, n, temp, group_rows,
                                               not args.unseeded)
                    else:
                        row = group_rows[unit[0]]
                        t0, c0 = time.perf_counter(), time.process_time()
                        outs = {unit[0]: runs[unit[0]](row)}
                        row.seconds.append(time.perf_counter() - t0)
                        row.cpu_seconds.append(time.process_time() - c0)
                    for m, out in outs.items():
                        row = group_rows[m]
                        row.tokens, row.outputs = sum(len(o) for o in out), out
                        print(f"  T={temp} batch={batch} repeat {rep + 1}/{args.repeats} {m:<24} "
                              f"{row.tokens / row.seconds[-1]:8.1f} tok/s {row.tokens / row.cpu_seconds[-1]:8.1f} "
                              f"tok/cpu-s  load {os.getloadavg()[0]:.1f}", flush=True)
            ref = group_rows.get("hf_generate")
            if ref is not None and SamplingParams(temperature=temp).greedy:
                for row in group_rows.values():
                    same = sum(a == b for a, b in zip(row.outputs, ref.outputs, strict=True))
                    row.greedy_match_vs_hf = f"{same}/{len(ref.outputs)}"
            rows += group_rows.values()
    return rows



def draftless_specs(args: argparse.Namespace, chain: dict) -> dict[str, dict]:
    """specserve_ngram (vLLM's keys, lookup 2..5) and specserve_suffix, each with the chain as fallback if asked."""
    k = args.draftless_k
    fallback = {"fallback": chain} if args.draftless_fallback else {}
    return {"specserve_ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 5, **fallback},
            "specserve_suffix": {"method": "suffix", "num_speculative_tokens": k,
                                 "suffix_decoding_cross_request": args.suffix_cross_request, **fallback}}


if __name__ == "__main__":
    raise SystemExit(main())
