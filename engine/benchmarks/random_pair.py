"""A random target of a given shape and a draft cut from it, for ``bench compare --random-shape`` (timing only).

The target is a random Llama checkpoint (engine/benchmarks/tp_step.py's ``make_random_checkpoint``); the draft
is the same checkpoint with only its first ``draft_layers`` layers (embeddings, final norm and head shared), so
it agrees with the target often enough for speculation to accept something while costing a fraction of it.
Only the shapes (and so the verify-vs-tokens curve) mean anything; acceptance is whatever this pair gives.
"""

from __future__ import annotations

import json
import os
import re

from engine.benchmarks.tp_step import make_random_checkpoint


def parse_shape(text: str) -> tuple[int, int, int]:
    """``HIDDEN,LAYERS,VOCAB`` (e.g. 1024,12,32000)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--random-shape must be HIDDEN,LAYERS,VOCAB (positive integers), got {text!r}")
    hidden, layers, vocab = (int(p) for p in parts)
    if hidden % 64:
        raise ValueError(f"--random-shape: hidden {hidden} must be a multiple of 64 (head size 64)")
    return hidden, layers, vocab


def make_random_pair(root: str, hidden: int, layers: int, vocab: int, draft_layers: int = 1) -> tuple[str, str]:
    """(target dir, draft dir) under ``root``; reused when already built there."""
    from safetensors.torch import load_file, save_file

    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    if not os.path.isfile(os.path.join(target, "config.json")):
        heads = hidden // 64
        make_random_checkpoint(target, hidden=hidden, layers=layers, vocab=vocab, heads=heads,
                               kv_heads=max(1, heads // 4), intermediate=int(hidden * 8 / 3) // 64 * 64)
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
