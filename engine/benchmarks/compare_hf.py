"""specserve against transformers on one machine, same prompts, greedy, measured in one run (issue 3).

    python -m engine.benchmarks.compare_hf [--target DIR --draft DIR --prompts FILE --max-tokens N
                                            --batch 8,32 --k 4 --json out.json]

Prints, side by side:
- batch 1: transformers ``generate``, transformers assisted generation (``assistant_model=draft``; with its
  default schedule, and with K constant to match ours), specserve without speculation and with a chain of K;
  output tokens/s, the ratios specserve-spec / HF-assisted and specserve-nospec / HF-generate, and the mean
  acceptance length (accepted + bonus tokens per verification round);
- batched throughput: specserve at each batch size vs transformers batched ``generate`` with left padding;
- one decode step at batch 1 without speculation: the engine's step time and the target forward alone, against
  the memory floor ``target weight bytes / bandwidth``, the bandwidth measured here with a large tensor copy
  (read + write bytes).

Systems are timed in turn within each repeat (interleaved), warm-up runs excluded; the tables show medians over
repeats. Every system generates exactly ``--max-tokens`` tokens (EOS does not stop anyone), so greedy outputs
must agree token for token; the table reports the matches (a near-tie can flip an argmax between differently
ordered float sums, so a rare mismatch after many tokens is numerics, not a bug).

On CPU the default models' fp16 weights are run in float32 (``--dtype``): half-precision matmuls have no fast
path on CPUs without AVX512-FP16 and cost several times more than float32 here, for transformers as for us.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "default_models")


# --------------------------------------------------------------------------------------------------- inputs
def load_prompts(path: str | None, tokenizer: Any, vocab: int, n: int, max_len: int) -> list[list[int]]:
    """Token ids of up to ``n`` prompts no longer than ``max_len``; random ids when there is no prompt file."""
    out: list[list[int]] = []
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                ids = r["prompt_token_ids"] if "prompt_token_ids" in r else tokenizer.encode(r["prompt"])
                if 0 < len(ids) <= max_len:
                    out.append(list(ids))
    if not out:
        gen = torch.Generator().manual_seed(0)
        out = [torch.randint(1, vocab, (32,), generator=gen).tolist() for _ in range(n)]
    while len(out) < n:  # fewer prompts than the largest batch: reuse them
        out += out[: n - len(out)]
    return out[:n]


# ---------------------------------------------------------------------------------------------- machine
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


# ----------------------------------------------------------------------------------------------- systems
class HF:
    """transformers ``generate`` on the target (optionally assisted by the draft), greedy, no EOS stop."""

    def __init__(self, target: str, draft: str, dtype: torch.dtype, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).eval()
        for m in (self.model, self.draft):
            m.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
            m.generation_config.pad_token_id = pad_id
        self.pad_id = pad_id

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int, assisted: bool = False,
                 k: int | None = None) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": False}
        if assisted:
            kw["assistant_model"] = self.draft
            if k is not None:
                kw.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0)
        out = self.model.generate(ids, attention_mask=mask, **kw)
        return out[:, width:].tolist()


class Engine:
    def __init__(self, target: str, spec: dict | None, dtype: str, max_seqs: int, kv_tokens: int) -> None:
        from engine.llm import LLM

        self.llm = LLM(target, speculative_config=spec, dtype=dtype, max_num_seqs=max_seqs,
                       num_kv_tokens=kv_tokens)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from scheduler.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in self.llm.generate(prompts, params)]

    @property
    def stats(self) -> Any:
        return self.llm.engine.stats

    def decode_steps(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Seconds of each ``step()`` after the prefill step, one request alone."""
        from scheduler.sampling_params import SamplingParams

        eng = self.llm.engine
        eng.add_request("step-timing", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True))
        times = []
        while eng.has_unfinished:
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        return times[1:]

    def target_runner(self) -> Any:
        """The in-process target worker's model runner, when the executor is local (else None)."""
        ex = getattr(self.llm.engine, "executor", None)
        worker = getattr(ex, "target", None) or getattr(self.llm.engine, "target", None)
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


# ---------------------------------------------------------------------------------------------- running
def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def matches(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return f"{same}/{len(a)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.benchmarks.compare_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="default: engine/default_models/target")
    ap.add_argument("--draft", default=None, help="default: engine/default_models/draft")
    ap.add_argument("--prompts", default=os.path.join(DEFAULT_DIR, "prompts.jsonl"),
                    help="JSONL with 'prompt' or 'prompt_token_ids' (random prompts when the file is missing)")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts run one at a time at batch 1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", default="8,32", help="batch sizes for the throughput table (comma-separated)")
    ap.add_argument("--k", type=int, default=4, help="chain length of specserve's speculation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--dtype", default="float32", help="compute dtype for both transformers and specserve")
    ap.add_argument("--skip-hf-constant-k", action="store_true", help="skip assisted generation with constant K")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.target is None or args.draft is None:
        from engine.config import default_model_dirs

        target, draft = default_model_dirs()  # a clear error when they are not installed
        args.target, args.draft = args.target or target, args.draft or draft

    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(args.target)
    batches = [int(b) for b in args.batch.split(",") if b]
    max_len = cfg.max_model_len - args.max_tokens - args.k - 2
    prompts = load_prompts(args.prompts, load_tokenizer(args.target), cfg.vocab_size,
                           max([args.num_prompts, *batches]), max_len)
    b1 = prompts[: args.num_prompts]
    dtype = getattr(torch, args.dtype)
    pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    longest = max(len(p) for p in prompts) + args.max_tokens + args.k + 2
    kv = max([*batches, 1]) * (longest + 16)
    chain = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}

    print(f"loading (dtype {args.dtype}, {args.threads} thread(s)) ...", flush=True)
    hf = HF(args.target, args.draft, dtype, pad)
    nospec = Engine(args.target, None, args.dtype, max([*batches, 1]), kv)
    spec = Engine(args.target, chain, args.dtype, max([*batches, 1]), kv)
    n = args.max_tokens

    # name -> (callable, prompts it runs as one call or one at a time)
    def batch1(fn: Callable[[list[list[int]]], list[list[int]]]) -> Callable[[], list[list[int]]]:
        return lambda: [fn([p])[0] for p in b1]

    systems: dict[str, Callable[[], list[list[int]]]] = {
        "hf_generate": batch1(lambda p: hf.generate(p, n)),
        "hf_assisted": batch1(lambda p: hf.generate(p, n, assisted=True)),
    }
    if not args.skip_hf_constant_k:
        systems[f"hf_assisted_k{args.k}"] = batch1(lambda p: hf.generate(p, n, assisted=True, k=args.k))
    systems["specserve_nospec"] = batch1(lambda p: nospec.generate(p, n))
    systems[f"specserve_chain_k{args.k}"] = batch1(lambda p: spec.generate(p, n))
    for b in batches:
        group = prompts[:b]
        systems[f"hf_generate@{b}"] = lambda g=group: hf.generate(g, n)
        systems[f"specserve_nospec@{b}"] = lambda g=group: nospec.generate(g, n)
        systems[f"specserve_chain_k{args.k}@{b}"] = lambda g=group: spec.generate(g, n)

    print("warm-up ...", flush=True)
    hf.generate(b1[:1], 4)
    hf.generate(b1[:1], 4, assisted=True)
    nospec.generate(b1[:1], 4)
    spec.generate(b1[:1], 4)
    for b in batches:  # first use of a batch shape allocates; keep it out of the timings
        hf.generate(prompts[:b], 2)
        nospec.generate(prompts[:b], 2)
        spec.generate(prompts[:b], 2)

    seconds: dict[str, list[float]] = {k: [] for k in systems}
    outputs: dict[str, list[list[int]]] = {}
    acc_len: list[float] = []
    for r in range(args.repeats):
        for name, fn in systems.items():
            if name == f"specserve_chain_k{args.k}":
                spec.stats.__init__()
            dt, out = timed(fn)
            if name == f"specserve_chain_k{args.k}":
                acc_len.append(spec.stats.mean_acceptance_length)
            seconds[name].append(dt)
            outputs[name] = out
            print(f"  repeat {r + 1}/{args.repeats} {name:<24} {len(out) * n / dt:8.1f} tok/s", flush=True)

    # One decode step at batch 1, no speculation.
    steps: list[float] = []
    for _ in range(args.repeats):
        for p in b1:
            steps += nospec.decode_steps(p, n)
    step_s = statistics.median(steps)
    ctx = len(b1[0]) + n // 2
    forward_s = time_forward_decode(nospec.target_runner(), ctx, 50)
    bw = copy_bandwidth()
    wbytes = weight_bytes(hf.model)
    floor_s = wbytes / bw

    def tok_s(name: str) -> float:
        calls = len(outputs[name])
        return calls * n / statistics.median(seconds[name])

    res = {name: {"tok_s": tok_s(name), "seconds": seconds[name]} for name in systems}
    ref = outputs["hf_generate"]
    for name in systems:
        base = name.split("@")[1] if "@" in name else None
        want = outputs[f"hf_generate@{base}"] if base else ref
        res[name]["greedy_match_vs_hf"] = matches(outputs[name], want)
    k_name = f"specserve_chain_k{args.k}"
    summary = {
        "spec_vs_hf_assisted": res[k_name]["tok_s"] / res["hf_assisted"]["tok_s"],
        "nospec_vs_hf_generate": res["specserve_nospec"]["tok_s"] / res["hf_generate"]["tok_s"],
        "mean_acceptance_length": statistics.median(acc_len) if acc_len else None,
        "decode_step_s": step_s,
        "decode_forward_s": forward_s,
        "weight_bytes": wbytes,
        "copy_bandwidth_bytes_per_s": bw,
        "weight_bytes_over_bandwidth_s": floor_s,
        "step_over_floor": step_s / floor_s,
        "forward_over_floor": forward_s / floor_s if forward_s else None,
    }
    for b in batches:
        summary[f"nospec_vs_hf@{b}"] = res[f"specserve_nospec@{b}"]["tok_s"] / res[f"hf_generate@{b}"]["tok_s"]
        summary[f"chain_vs_hf@{b}"] = res[f"{k_name}@{b}"]["tok_s"] / res[f"hf_generate@{b}"]["tok_s"]
    report(args, res, summary, batches)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__},
                       "results": res, "summary": summary}, f, indent=1)
    return 0


def report(args: argparse.Namespace, res: dict, s: dict, batches: list[int]) -> None:
    print(f"\ntarget {args.target}\ndraft  {args.draft}\n{args.num_prompts} prompts at batch 1, {args.max_tokens} "
          f"tokens each, greedy, dtype {args.dtype}, {args.threads} thread(s), median of {args.repeats} repeats\n")
    print(f"{'system':<26} {'batch':>5} {'tok/s':>9} {'greedy = HF':>12}")
    for name, r in res.items():
        system, _, b = name.partition("@")
        print(f"{system:<26} {b or '1':>5} {r['tok_s']:>9.1f} {r['greedy_match_vs_hf']:>12}")
    print(f"\nbatch 1: specserve chain K={args.k} / HF assisted = {s['spec_vs_hf_assisted']:.2f}x   "
          f"(target >= 2x); specserve no-spec / HF generate = {s['nospec_vs_hf_generate']:.2f}x")
    if s["mean_acceptance_length"] is not None:
        print(f"mean acceptance length (accepted + bonus per round): {s['mean_acceptance_length']:.2f}")
    for b in batches:
        print(f"batch {b}: specserve no-spec / HF generate = {s[f'nospec_vs_hf@{b}']:.2f}x, "
              f"chain / HF generate = {s[f'chain_vs_hf@{b}']:.2f}x")
    fwd = f", target forward alone {1e3 * s['decode_forward_s']:.2f} ms ({s['forward_over_floor']:.2f}x)" \
        if s["decode_forward_s"] else ""
    print(f"\ndecode step, batch 1, no speculation: {1e3 * s['decode_step_s']:.2f} ms per step{fwd}\n"
          f"  floor: {s['weight_bytes'] / 1e6:.1f} MB of target weights / {s['copy_bandwidth_bytes_per_s'] / 1e9:.1f}"
          f" GB/s copy bandwidth (read + write) = {1e3 * s['weight_bytes_over_bandwidth_s']:.2f} ms; "
          f"step / floor = {s['step_over_floor']:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    raise SystemExit(main())
