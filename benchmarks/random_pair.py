"""A random target of a given shape and a draft cut from it, for ``bench compare --random-shape`` (timing only).

The target is a random Llama checkpoint (``make_random_checkpoint``); the draft
is the same checkpoint with only its first ``draft_layers`` layers (embeddings, final norm and head shared).

A plainly random target and its cut disagree almost always (each random layer adds as much to the residual
stream as the embedding did), which makes adaptive speculation's choice trivial (K = 0). So the target's deeper
layers write into the residual stream at ``deep_scale`` of their random size and the head is ``head_scale``
times sharper: the deep layers still cost their full compute, but perturb the draft's answer instead of
replacing it. With the defaults, measured at hidden 1024, 12 layers, vocab 32k on the target's own greedy
continuations of random prompts: the draft's greedy pick agrees with the target's 72 % of the time, and at
T = 0.8 a draft token is accepted with probability 0.81 (sum of min(p, q)) -- about what the built-in trained
pair gives, so the cost model meets a realistic acceptance at a larger shape.
"""

from __future__ import annotations

import json
import os
import re


def make_random_checkpoint(path: str, *, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int,
                           intermediate: int, seed: int = 0) -> str:
    """A random Llama checkpoint (float32, logits O(1)); only the shapes matter for timing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def parse_shape(text: str) -> tuple[int, int, int]:
    """``HIDDEN,LAYERS,VOCAB`` (e.g. 1024,12,32000)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--random-shape must be HIDDEN,LAYERS,VOCAB (positive integers), got {text!r}")
    hidden, layers, vocab = (int(p) for p in parts)
    if hidden % 64:
        raise ValueError(f"--random-shape: hidden {hidden} must be a multiple of 64 (head size 64)")
    return hidden, layers, vocab


# Matches the output projections of decoder layer N (what each layer adds to the residual stream).
_RESIDUAL_WRITE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight")


def make_random_pair(root: str, hidden: int, layers: int, vocab: int, draft_layers: int = 1,
                     deep_scale: float = 0.03, head_scale: float = 4.0) -> tuple[str, str]:
    """(target dir, draft dir) under ``root``; reused when already built there."""
    from safetensors.torch import load_file, save_file

    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    if not os.path.isfile(os.path.join(target, "config.json")):
        heads = hidden // 64
        make_random_checkpoint(target, hidden=hidden, layers=layers, vocab=vocab, heads=heads,
                               kv_heads=max(1, heads // 4), intermediate=int(hidden * 8 / 3) // 64 * 64)
        path = os.path.join(target, "model.safetensors")
        weights = load_file(path)
        for k, v in weights.items():
            if (m := _RESIDUAL_WRITE.match(k)) and int(m.group(1)) >= draft_layers:
                weights[k] = v * deep_scale
        weights["lm_head.weight"] = weights["lm_head.weight"] * head_scale
        save_file(weights, path, metadata={"format": "pt"})
    if not os.path.isfile(os.path.join(draft, "config.json")):
        os.makedirs(draft, exist_ok=True)
        weights = load_file(os.path.join(target, "model.safetensors"))
        keep = {k: v for k, v in weights.items()
                if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < draft_layers}
        save_file(keep, os.path.join(draft, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"] = draft_layers
        with open(os.path.join(draft, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    return target, draft
