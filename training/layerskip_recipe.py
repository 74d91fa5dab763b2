"""LayerSkip's recipe on a tiny model, so its own final norm and head can exit early (the adapter-free layer_skip).

A model trained only on the last layer's next-token loss has no reason to make an early layer's residual stream
readable by its final norm and head: self-speculation from it needs an exit adapter (training/exit_adapter.py).
LayerSkip (Elhoushi et al., 2024) trains the model itself for early exit with two changes, both here:

- **layer dropout rising with depth**: each decoder layer is skipped per sequence with probability
  ``max_dropout * l / (N - 1)`` (layer 0 never, the last most often; a skipped layer is the identity of the
  residual stream), so later layers learn to refine rather than rewrite and earlier ones to carry the prediction;
- **an early-exit loss at every layer**: next-token cross-entropy of ``head(norm(h_l))`` for every layer's output
  h_l through the *shared* final norm and head, weighted rising with depth (``l / sum``), beside the last layer's.

The same model trained without them (``recipe=False``: plain next-token loss, same data, steps and seed) is the
baseline: ``{"method": "layer_skip", "exit_layer": L}`` without ``model`` accepts more on the recipe-trained one.

    python -m training.layerskip_recipe --out /tmp/ls --baseline /tmp/ls-plain --measure
    python -m training.layerskip_recipe --out /tmp/ls --baseline /tmp/ls-plain --quick --measure  # seconds

Data: the Python standard library's held-in files (training/data.py's split), encoded with the built-in target's
tokenizer (4,096 ids), which the saved checkpoints carry too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "engine" / "default_models" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class RecipeConfig:
    layers: int = 6  # N: deep enough that an early exit skips most of the work
    hidden: int = 128  # small: minutes on one CPU core
    heads: int = 4
    ffn: int = 320
    steps: int = 800
    minutes: float = 15.0  # the run ends at whichever of steps / time comes first
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    max_dropout: float = 0.2  # the last layer's skip rate: earlier-layer readiness vs the final layer's quality
    exit_scale: float = 1.0  # the early-exit losses' weight beside the last layer's: exits vs the full model
    exit_share: float = 0.25  # positions whose exits are scored per step (an unbiased estimate of the exits'
    #                           loss): the head over every layer's every row is most of a step's cost on CPU
    recipe: bool = True  # False: the baseline (last layer's loss only, no layer dropout)
    files: int = 300  # stdlib files encoded: corpus size vs start-up seconds
    seed: int = 1234


QUICK = RecipeConfig(layers=4, hidden=64, heads=4, ffn=160, steps=80, minutes=5.0, batch=8, seq_len=64,
                     files=60)


def corpus(files: int) -> np.ndarray:
    """Token ids of the first ``files`` held-in stdlib files, EOS-separated (training/data.py's stream)."""
    from tokenizers import Tokenizer

    from training.data import collect_files, encode_files

    train, _ = collect_files()
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return encode_files(tok, train[:files]).astype(np.int64)


def model_config(cfg: RecipeConfig) -> LlamaConfig:
    target = json.loads((TOKENIZER_DIR / "config.json").read_text())
    return LlamaConfig(vocab_size=target["vocab_size"], hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                       head_dim=cfg.hidden // cfg.heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                       bos_token_id=target["bos_token_id"], eos_token_id=target["eos_token_id"],
                       pad_token_id=target["pad_token_id"], tie_word_embeddings=True)


class LayerDropout:
    """Forward hooks that skip decoder layer l per sequence with probability ``max_dropout * l / (N - 1)``."""

    def __init__(self, model: LlamaForCausalLM, max_dropout: float, gen: torch.Generator) -> None:
        layers = model.model.layers
        self.rates = [max_dropout * i / max(1, len(layers) - 1) for i in range(len(layers))]
        self.gen = gen
        self.handles = [layer.register_forward_hook(self._hook(r), with_kwargs=True)
                        for layer, r in zip(layers, self.rates, strict=True)]

    def _hook(self, rate: float):
        def hook(module, args, kwargs, output):
            if rate == 0 or not module.training:
                return output
            inp = args[0] if args else kwargs["hidden_states"]  # [B, T, H]
            out = output[0] if isinstance(output, tuple) else output
            keep = (torch.rand(inp.shape[0], 1, 1, generator=self.gen) >= rate).to(out.dtype)  # [B, 1, 1]
            mixed = inp + keep * (out - inp)
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def recipe_loss(model: LlamaForCausalLM, batch: torch.Tensor, cfg: RecipeConfig, gen: torch.Generator
                ) -> tuple[torch.Tensor, dict]:
    """The last layer's next-token loss, plus (recipe) every earlier layer's through the shared norm and head."""
    x, y = batch[:, :-1], batch[:, 1:]  # [B, T] each
    out = model(input_ids=x, output_hidden_states=cfg.recipe)
    final = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())
    if not cfg.recipe:
        return final, {"final": final.item()}
    # hidden_states: the embeddings, then each layer's output; the last is already through the final norm
    states = out.hidden_states[1:-1]  # layers 0 .. N-2's outputs: exits at L = 1 .. N-1, [B, T, H] each
    weights = torch.arange(1, len(states) + 1, dtype=torch.float32)
    weights = weights / weights.sum()  # rising with depth, as LayerSkip's early-exit scale
    rows = y.numel()
    pick = torch.randperm(rows, generator=gen)[: max(1, round(rows * cfg.exit_share))]  # [P] scored positions
    exits = [F.cross_entropy(model.lm_head(model.model.norm(h.flatten(0, 1)[pick])).float(), y.flatten()[pick])
             for h in states]
    early = sum(w * e for w, e in zip(weights.tolist(), exits, strict=True))
    return final + cfg.exit_scale * early, {"final": final.item(), **{f"exit{i + 1}": e.item()
                                                                      for i, e in enumerate(exits)}}


def train(cfg: RecipeConfig, out: str, data: np.ndarray | None = None) -> dict:
    """Trains a model from scratch with (or, ``recipe=False``, without) the recipe; saves it (fp16, with the
    built-in target's tokenizer) at ``out``. Returns the run's summary."""
    torch.manual_seed(cfg.seed)
    data = corpus(cfg.files) if data is None else data
    model = LlamaForCausalLM(model_config(cfg)).float().train()
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    dropout = LayerDropout(model, cfg.max_dropout, gen) if cfg.recipe else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    start, step, parts = time.time(), 0, {}
    while step < cfg.steps and time.time() - start < cfg.minutes * 60:
        for g in opt.param_groups:  # linear warm-up, then cosine to a tenth
            progress = step / cfg.steps
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.45 * (1 + np.cos(np.pi * progress)))
        starts = rng.integers(0, data.size - cfg.seq_len - 1, size=cfg.batch)
        batch = torch.from_numpy(np.stack([data[s: s + cfg.seq_len + 1] for s in starts]))  # [B, T + 1]
        loss, parts = recipe_loss(model, batch, cfg, gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
    if dropout is not None:
        dropout.remove()
    save(model.eval(), out)
    return {"recipe": cfg.recipe, "steps": step, "seconds": round(time.time() - start, 1),
            "losses": {k: round(v, 3) for k, v in parts.items()}, "config": asdict(cfg)}


def save(model: LlamaForCausalLM, out: str) -> None:
    half = model.to(torch.float16)
    half.config.dtype = torch.float16
    Path(out).mkdir(parents=True, exist_ok=True)
    half.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, Path(out) / name)


def acceptance(target: str, exit_layer: int, prompts: list[list[int]], k: int = 4, max_tokens: int = 32
               ) -> tuple[float, bool]:
    """(mean acceptance length incl. the bonus token, whether greedy output equals no speculation): batch 1
    greedy, ``{"method": "layer_skip", "exit_layer": L}`` without ``model`` (the model's own norm and head)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(target, None, max_num_seqs=1) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "layer_skip", "exit_layer": exit_layer, "num_speculative_tokens": k}
    with LLM(target, spec, max_num_seqs=1) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        return llm.engine.stats.mean_acceptance_length, got == want


def heldout_prompts(n: int, length: int = 24) -> list[list[int]]:
    """Openings of held-out stdlib files (training/data.py's split), as token ids."""
    from tokenizers import Tokenizer

    from training.data import collect_files

    _, held = collect_files()
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return [tok.encode(f.text).ids[:length] for f in held[:n]]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m training.layerskip_recipe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the recipe-trained checkpoint")
    ap.add_argument("--baseline", default=None, help="also train the same model without the recipe, here")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--measure", default=None, help="exit layers L to measure acceptance at (e.g. 1,2)")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts measured")
    ap.add_argument("--quick", action="store_true", help="a tiny model for seconds (what the test runs)")
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else RecipeConfig()
    cfg = replace(cfg, **{k: v for k, v in (("steps", a.steps), ("minutes", a.minutes)) if v is not None})
    data = corpus(cfg.files)
    runs = {"recipe": train(cfg, a.out, data)}
    if a.baseline:
        runs["plain"] = train(replace(cfg, recipe=False), a.baseline, data)
    for r in runs.values():
        print(json.dumps({k: v for k, v in r.items() if k != "config"}), flush=True)
    if a.measure:
        prompts = heldout_prompts(a.prompts)
        dirs = {"recipe": a.out, **({"plain": a.baseline} if a.baseline else {})}
        table = {f"{name} L{L}": acceptance(d, L, prompts) for name, d in dirs.items()
                 for L in (int(x) for x in a.measure.split(","))}
        print(json.dumps(table), flush=True)
        runs["acceptance"] = table
    return runs


if __name__ == "__main__":
    main()
