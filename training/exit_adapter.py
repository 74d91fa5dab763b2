"""Train a Kangaroo-style exit adapter for a frozen target: ``python -m training.exit_adapter``.

The adapter (workers/layer_skip/exit.py: a residual MLP block) reads the input of layer L and, through the
target's own final norm and head, is fitted to the target's next-token law: KL(target || exit) on the target's
hidden states over sequences of the built-in corpus and the target's own continuations (training/eagle.py's
``builtin_sequences``). Only the adapter learns; the target is frozen, so drafting with it stays lossless
whatever it learns (the verify pass decides).

``--target smollm2`` (or a checkpoint) trains on that target instead of the built-in one: corpus windows in its
tokenizer plus its own continuations, measured on its held-out chat prompts (``--heldout``).

``--layers 2,3,4`` trains one adapter per L and measures each with the engine (held-out prompts, batch 1 greedy,
K = ``--k``): acceptance length and tokens/s beside no speculation; the best tokens/s is kept in ``--out``, with a
model card. ``--quick``: a smoke run of seconds (useless weights, no measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workers.attention import DenseCausalContext
from workers.layer_skip.exit import VOCAB_FILE, ExitAdapter, ExitAdapterConfig, target_name
from workers.loader import load_model


@dataclass
class ExitTrainConfig:
    minutes: float = 3.0  # wall-clock budget per adapter: acceptance vs training time
    steps: int = 1500  # at most this many optimiser steps
    batch: int = 8
    seq_len: int = 128
    adapter_size: int = 640  # the MLP's inner width: acceptance vs the exit's cost per drafted token
    lr: float = 2e-3
    seed: int = 0


def target_states(target: torch.nn.Module, tokens: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens -> (the input of ``layer`` [B, T, H], the target's log-probs [B, T, V]), no gradients."""
    b, t = tokens.shape
    target.model.aux_layers = (layer,)
    with torch.no_grad():
        hidden = target(tokens.reshape(-1), torch.arange(t).repeat(b), DenseCausalContext([t] * b))  # [B*T, H]
        logp = F.log_softmax(target.compute_logits(hidden).float(), dim=-1)
    return target.model.aux_hidden.reshape(b, t, -1).float(), logp.reshape(b, t, -1)


def other_sequences(target_path: str, n_windows: int, seq_len: int, n_gen: int, gen_tokens: int,
                    seed: int) -> list[list[int]]:
    """A target with its own tokenizer (SmolLM2's GGUF file, a checkpoint): stdlib corpus windows (training/data.py's
    train split) in that tokenizer, and the target's own continuations of some (half greedy, half T = 0.8)."""
    from engine import LLM, SamplingParams
    from training.data import collect_files
    from workers.loader import load_tokenizer

    tok = load_tokenizer(target_path)
    train, _ = collect_files()
    rng = random.Random(seed)
    stream = [i for f in rng.sample(train, min(len(train), 200)) for i in tok.encode(f.text)]
    starts = [rng.randrange(0, len(stream) - seq_len) for _ in range(n_windows + n_gen)]
    text = [stream[s: s + seq_len] for s in starts[:n_windows]]
    prompts = [stream[s: s + 32] for s in starts[n_windows:]]
    if not prompts:
        return text
    llm = LLM(target_path, "none", max_num_seqs=16)
    params = [SamplingParams(max_tokens=gen_tokens, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    answers = [p + list(o.token_ids) for p, o in zip(prompts, llm.generate(prompts, params), strict=True)]
    llm.shutdown()
    return text + answers


def train_adapter(target_path: str, seqs: list[list[int]], layer: int, out: str, cfg: ExitTrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    target = load_model(target_path, dtype=torch.float32).eval()
    tc = target.config
    c = ExitAdapterConfig(exit_layer=layer, target=target_name(target_path), hidden_size=tc.hidden_size,
                          adapter_size=cfg.adapter_size, num_layers=tc.num_layers, rms_norm_eps=tc.rms_norm_eps)
    adapter = ExitAdapter(c)
    adapter.norm.weight.requires_grad_(True)
    torch.nn.init.zeros_(adapter.down.weight)  # starts as the adapter-free exit, and only improves on it
    head_w = target.lm_head.weight.detach().float()  # [V, H] (tensor-parallel size 1)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    seqs = [s[: cfg.seq_len] for s in seqs if len(s) >= cfg.seq_len]
    start, step, loss_v, top1 = time.time(), 0, float("nan"), 0.0
    while step < cfg.steps and time.time() - start < cfg.minutes * 60:
        tokens = torch.tensor(rng.sample(seqs, min(cfg.batch, len(seqs))))  # [B, T]
        h, logp = target_states(target, tokens, layer)
        exit_logp = F.log_softmax(F.linear(target.model.norm(adapter(h)), head_w), dim=-1)  # [B, T, V]
        loss = F.kl_div(exit_logp, logp, log_target=True, reduction="batchmean") / tokens.shape[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        loss_v = loss.item()
        top1 = (exit_logp.argmax(-1) == logp.argmax(-1)).float().mean().item()
    adapter.eval().requires_grad_(False)
    Path(out).mkdir(parents=True, exist_ok=True)
    adapter.save(out)
    return {"exit_layer": layer, "steps": step, "seconds": round(time.time() - start, 1),
            "loss": round(loss_v, 4), "train_top1": round(top1, 3), "config": asdict(cfg)}


def measure(target: str, adapters: dict[str, str | None], prompts: list, k: int, max_tokens: int = 64) -> dict:
    """Batch 1 greedy, every setup loaded at once and run in turn on each prompt (so machine load hits them alike):
    mean acceptance length and tokens/s per name (an adapter of None: no speculation)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llms = {name: LLM(target, None if a is None else {"method": "layer_skip", "model": a, "num_speculative_tokens": k},
                      max_num_seqs=1) for name, a in adapters.items()}
    seconds = dict.fromkeys(llms, 0.0)
    tokens = dict.fromkeys(llms, 0)
    try:
        for llm in llms.values():
            llm.generate(prompts[:1], params)  # warm-up
            llm.engine.reset_stats()
        for p in prompts:
            for name, llm in llms.items():
                start = time.perf_counter()
                tokens[name] += len(llm.generate([p], params)[0].token_ids)
                seconds[name] += time.perf_counter() - start
        return {name: {"mean_acceptance_length": round(llm.engine.stats.mean_acceptance_length, 3)
                       if adapters[name] else 1.0, "tokens_per_s": round(tokens[name] / seconds[name], 1)}
                for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.shutdown()


CARD = """# Exit adapter for {target}

A Kangaroo-style exit adapter (workers/layer_skip/exit.py: a residual MLP block of width {width}, then the
target's own final norm and head) on the input of layer **{layer}** of `{target}` ({layers} layers): the target's
first {layer} layers plus this adapter draft, the whole target verifies (`{{"method": "layer_skip"}}` on this target
uses it). Trained on a frozen target: KL(target || exit), training/exit_adapter.py.

- **Command**: `{command}`
- **Runs** (per L: steps, seconds on a shared 2-core CPU, train top-1 agreement with the target): {runs}
- **Choice of L**, the best tokens/s (engine, {n} held-out prompts, batch 1 greedy, K = {k}, every setup loaded at
  once and run in turn per prompt on the loaded machine; acceptance length incl. the bonus token): {table}
"""


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m training.exit_adapter", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="2,4", help="the exit layers L to train and measure")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=ExitTrainConfig.minutes)
    ap.add_argument("--steps", type=int, default=ExitTrainConfig.steps)
    ap.add_argument("--batch", type=int, default=ExitTrainConfig.batch)
    ap.add_argument("--seq-len", type=int, default=ExitTrainConfig.seq_len)
    ap.add_argument("--adapter-size", type=int, default=ExitTrainConfig.adapter_size)
    ap.add_argument("--windows", type=int, default=400, help="corpus windows")
    ap.add_argument("--gen", type=int, default=64, help="continuations the target writes")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts measured per L")
    ap.add_argument("--target", default="builtin", help="builtin, smollm2, or a checkpoint")
    ap.add_argument("--heldout", default="engine/default_models/smollm2-draft",
                    help="another target's held-out prompts: DIR/heldout_prompts.jsonl")
    ap.add_argument("--vocab", default=None, help="a JSON file with 'ids' (e.g. a draft's draft_vocab_map.json): the "
                                                 "adapters draft only those ids (workers/layer_skip/exit.py)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of seconds (useless weights, no measurement)")
    a = ap.parse_args(argv)
    from engine.core.config import default_model_dirs
    from training.eagle import builtin_sequences, heldout_prompts
    from workers.gguf_loader import resolve_model_path

    builtin = a.target == "builtin"
    target = default_model_dirs()[0] if builtin else resolve_model_path(a.target)
    cfg = ExitTrainConfig(minutes=a.minutes, steps=a.steps, batch=a.batch, seq_len=a.seq_len,
                          adapter_size=a.adapter_size)
    if a.quick:
        cfg = ExitTrainConfig(minutes=0.5, steps=3, batch=2, seq_len=32, adapter_size=32)
    n = (8, 2, 8) if a.quick else (a.windows, a.gen, 96)  # windows, continuations, their length
    seqs = (builtin_sequences(target, n[0], cfg.seq_len, n[1], n[2], cfg.seed)[0] if builtin
            else other_sequences(target, n[0], cfg.seq_len, n[1], n[2], cfg.seed))
    layers = [int(x) for x in a.layers.split(",")][:1 if a.quick else None]
    prompts = [] if a.quick else heldout_prompts(
        "builtin" if builtin else a.target, a.heldout)[: a.prompts]
    runs, outs = {}, {}
    for layer in layers:
        outs[layer] = a.out if len(layers) == 1 else f"{a.out}.L{layer}"
        runs[layer] = train_adapter(target, seqs, layer, outs[layer], cfg)
        if a.vocab:
            with open(a.vocab) as f, open(os.path.join(outs[layer], VOCAB_FILE), "w") as g:
                json.dump({"ids": sorted(json.load(f)["ids"])}, g)
        print(json.dumps({k: v for k, v in runs[layer].items() if k != "config"}), flush=True)
    table = measure(target, {"none": None, **{f"L{L}": outs[L] for L in layers}}, prompts, a.k) if prompts else {}
    print(json.dumps(table), flush=True)
    best = max(layers, key=lambda L: table[f"L{L}"]["tokens_per_s"]) if prompts else layers[0]
    if len(layers) > 1:
        if os.path.exists(a.out):
            shutil.rmtree(a.out)
        shutil.copytree(outs[best], a.out)
        for layer in layers:
            shutil.rmtree(outs[layer])
    runs_txt = "; ".join(f"L {r['exit_layer']}: {r['steps']} steps, {r['seconds']} s, top-1 {r['train_top1']}"
                         for r in runs.values())
    with open(os.path.join(a.out, "MODEL_CARD.md"), "w") as f:
        f.write(CARD.format(target=target_name(target), width=cfg.adapter_size, layer=best,
                            layers=ExitAdapterConfig.from_pretrained(a.out).num_layers,
                            command="python -m training.exit_adapter " + " ".join(argv), runs=runs_txt, k=a.k,
                            n=len(prompts),
                            table=json.dumps(table) if prompts else "not measured (--quick)"))


if __name__ == "__main__":
    main()
