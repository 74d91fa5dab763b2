"""``specserve bench compare``: every decoding mode side by side, one run, same prompts, same settings.

Modes: transformers ``generate``, transformers assisted generation (``assistant_model``, batch 1 only, as
transformers supports it), specserve without speculation, with chain speculation, with tree speculation at the
same verification budget (nodes verified per round), and chain speculation pipelined. For each temperature and
batch size it prints output tokens/s, mean acceptance length, ratios, and where the engine's time goes against
the cycle-cost model: time per token = (draft + verify + commit per round) / tokens per round.

    python -m engine.benchmarks.compare --json runs/compare.json
    python -m engine.benchmarks.compare --target smollm2 --quantization none --draft smollm2 \
        --draft-quantization gguf --batches 1 --temperatures 0      # a GGUF target, its own 4-bit copy drafting
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import default_model_dirs

DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "default_models",
                               "prompts.jsonl")


@dataclass
class Result:
    mode: str
    temperature: float
    batch: int
    tokens: int
    seconds: float
    acceptance_length: float | None = None
    breakdown: dict | None = None
    pipeline: dict | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def load_prompts(path: str, n: int, tokenizer: Any) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in rows[:n]:
        out.append(r["prompt_token_ids"] if "prompt_token_ids" in r else tokenizer.encode(r["prompt"]))
    return out


def _batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    return [prompts[i: i + batch] for i in range(0, len(prompts), batch)]


def _hf_model(path: str) -> Any:
    """transformers' float32 model of a checkpoint directory or a GGUF file (dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf(target: str, draft: str | None, prompts: list[list[int]], batch: int, temperature: float,
           max_tokens: int, pad_id: int) -> Result:
    model = _hf_model(target)
    assistant = _hf_model(draft) if draft else None
    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "pad_token_id": pad_id}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    tokens, seconds = 0, 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for group in _batches(prompts, batch):
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kwargs)
            seconds += time.perf_counter() - start
            tokens += (out.shape[1] - width) * len(group)
    name = "hf_assisted" if draft else "hf_generate"
    return Result(name, temperature, batch, tokens, seconds)


def run_engine(mode: str, target: str, spec: dict | None, prompts: list[list[int]], batch: int,
               temperature: float, max_tokens: int, backend: str | None, quantization: str | None = None) -> Result:
    from engine import LLM, SamplingParams

    llm = LLM(target, speculative_config=spec, distributed_executor_backend=backend, max_num_seqs=max(batch, 8),
              quantization=quantization)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True))  # warm-up
        eng = llm.engine
        eng.stats.__init__()
        eng.times.__init__()
        if eng.pipeline is not None:
            eng.pipeline.stats.__init__()
        tokens, seconds = 0, 0.0
        for i, group in enumerate(_batches(prompts, batch)):
            params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                     seed=1000 * i + j) for j in range(len(group))]
            start = time.perf_counter()
            outs = llm.generate(group, params)
            seconds += time.perf_counter() - start
            tokens += sum(len(o.token_ids) for o in outs)
        acc = eng.stats.mean_acceptance_length if spec else None
        pipe = eng.pipeline.stats.as_dict() if eng.pipeline is not None else None
        return Result(mode, temperature, batch, tokens, seconds, acc, eng.times.as_dict(), pipe)
    finally:
        llm.shutdown()


def cycle_model(r: Result) -> dict | None:
    """Predicted seconds per token from the breakdown vs the measured wall time per token."""
    b = r.breakdown
    if not b or not b["steps"] or not r.tokens:
        return None
    draft = b["draft_wall_s"] + b["collect_s"]
    verify = b["verify_wall_s"]
    state = b["commit_s"] + b["schedule_s"]
    return {"draft_s_per_tok": (draft / r.tokens), "verify_s_per_tok": verify / r.tokens,
            "state_s_per_tok": state / r.tokens, "model_s_per_tok": (draft + verify + state) / r.tokens,
            "measured_s_per_tok": r.seconds / r.tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="chain length")
    ap.add_argument("--tree", default="2,1", help="tree branching with the same node budget as the chain "
                    "(default 2,1: 4 nodes, like a chain of 4)")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    ap.add_argument("--backend", choices=["uni", "ray"], default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", choices=["gguf", "none"], default=None, help="GGUF target's weights")
    ap.add_argument("--draft-quantization", choices=["gguf", "none"], default=None, help="GGUF draft's weights")
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.target is None or args.draft is None:
        t, d = default_model_dirs()
        args.target, args.draft = args.target or t, args.draft or d
    from workers.gguf_loader import resolve_model_path

    args.target, args.draft = resolve_model_path(args.target), resolve_model_path(args.draft)
    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    tok = load_tokenizer(args.target)
    prompts = load_prompts(args.prompts, args.num_prompts, tok)
    pad = ModelConfig.from_pretrained(args.target).eos_token_ids[0]
    tree = [int(x) for x in args.tree.split(",")]
    chain = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
             "quantization": args.draft_quantization}
    modes = [("specserve_nospec", None), ("specserve_chain", chain),
             ("specserve_tree", {**chain, "num_speculative_tokens": len(tree), "tree_branching": tree}),
             ("specserve_pipelined", {**chain, "pipeline": True})]
    results: list[Result] = []
    for temp in [float(x) for x in args.temperatures.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            if not args.skip_hf:
                results.append(run_hf(args.target, None, prompts, batch, temp, args.max_tokens, pad))
                if batch == 1:
                    results.append(run_hf(args.target, args.draft, prompts, batch, temp, args.max_tokens, pad))
            for name, spec in modes:
                results.append(run_engine(name, args.target, spec, prompts, batch, temp, args.max_tokens,
                                          args.backend, args.quantization))
                r = results[-1]
                print(f"  T={temp} batch={batch} {name}: {r.tok_s:.1f} tok/s", flush=True)
    report(results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [{**r.__dict__, "tok_s": r.tok_s, "cycle_model": cycle_model(r)}
                                                       for r in results]}, f, indent=1)
    return 0


def report(results: list[Result]) -> None:
    print(f"\n{'T':>4} {'batch':>5} {'mode':<22} {'tok/s':>8} {'acc.len':>7} {'vs chain':>8} {'vs HF-asst':>10}")
    for key in sorted({(r.temperature, r.batch) for r in results}):
        group = [r for r in results if (r.temperature, r.batch) == key]
        by = {r.mode: r for r in group}
        chain = by.get("specserve_chain")
        hf_asst = by.get("hf_assisted")
        for r in group:
            vs_chain = f"{r.tok_s / chain.tok_s:.2f}x" if chain and chain.tok_s else "-"
            vs_hf = f"{r.tok_s / hf_asst.tok_s:.2f}x" if hf_asst and hf_asst.tok_s else "-"
            acc = f"{r.acceptance_length:.2f}" if r.acceptance_length else "-"
            print(f"{key[0]:>4} {key[1]:>5} {r.mode:<22} {r.tok_s:>8.1f} {acc:>7} {vs_chain:>8} {vs_hf:>10}")
    print("\nwhere the engine's time goes (ms per output token; model = draft + verify + state):")
    for r in results:
        c = cycle_model(r)
        if c:
            print(f"  T={r.temperature} b={r.batch} {r.mode:<22} draft {1e3 * c['draft_s_per_tok']:.2f}  verify "
                  f"{1e3 * c['verify_s_per_tok']:.2f}  state {1e3 * c['state_s_per_tok']:.2f}  model "
                  f"{1e3 * c['model_s_per_tok']:.2f}  measured {1e3 * c['measured_s_per_tok']:.2f}"
                  + (f"  pipeline {r.pipeline}" if r.pipeline else ""))


if __name__ == "__main__":
    raise SystemExit(main())
