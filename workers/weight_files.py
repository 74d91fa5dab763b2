"""The weight files of a Hugging Face checkpoint directory, read lazily.

Weights come from ``*.safetensors`` only (one file, or shards listed in ``model.safetensors.index.json``), as
lazy safetensors slices: with tensor parallelism each rank reads just its own rows/columns from disk. The model
loaders (workers/loader.py, workers/models/deepseek_v4.py) both read through here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from safetensors import safe_open

from workers.layers import WeightSource

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(path: str) -> list[str]:
    """The weight files of a checkpoint: the index's shards, else model.safetensors, else every *.safetensors."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r} (PyTorch .bin checkpoints are not "
                                "supported; convert them with save_pretrained(..., safe_serialization=True))")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"{path!r}: weight shards listed in {INDEX_FILE} are missing: {missing}")
    return [os.path.join(path, f) for f in files]


def iter_weights(path: str) -> Iterator[tuple[str, WeightSource]]:
    """(HF name, lazy slice) for every tensor; a slice is only valid until the next item is requested."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
