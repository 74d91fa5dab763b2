"""Build a model from a local Hugging Face checkpoint directory or a GGUF file (workers/gguf_loader.py).

Weights come from ``*.safetensors`` only (workers/weight_files.py), handed to ``model.load_weights`` as lazy
slices, so with tensor parallelism each rank reads just its own rows/columns from disk. Parameters are
allocated directly on ``device`` in the target dtype and never randomly initialised.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import torch

from workers import gguf_loader
from workers.distributed import TPGroup
from workers.gguf_metadata import is_gguf
from workers.layers import make_row_invariant
from workers.model_config import ModelConfig, parse_dtype
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import model_class_for
from workers.weight_files import iter_weights

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_dtype(path: str) -> torch.dtype:
    """The dtype config.json declares, or, when it declares none, that of the first floating tensor stored."""
    with open(os.path.join(path, "config.json")) as f:
        raw: dict[str, Any] = json.load(f)
    declared = raw.get("dtype") or raw.get("torch_dtype")
    if declared is not None:
        return parse_dtype(declared)
    for _, src in iter_weights(path):
        stored = _SAFETENSORS_DTYPES.get(src.get_dtype())  # type: ignore[union-attr]
        if stored is not None:
            return stored
    return torch.float32


QUANTIZATION_CHOICES = ("gguf", "none", "q8_0")


def resolve_quantization(path: str | os.PathLike[str], quantization: str | None) -> str:
    """"gguf" (Q4 weights stay packed), "none", or "q8_0" (a float checkpoint's matrices held as Q8_0 blocks:
    workers/q8_weights.py); None picks "gguf" for a block-quantized GGUF file."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)}, got {quantization!r}")
    gguf = is_gguf(path)
    if quantization == "gguf" and not gguf:
        raise ValueError(f"quantization 'gguf' needs a *.gguf model file, got {os.fspath(path)!r}")
    if quantization == "q8_0" and gguf:
        raise ValueError(f"quantization 'q8_0' is for a float checkpoint directory; a GGUF file keeps its own "
                         f"blocks with 'gguf', got {os.fspath(path)!r}")
    if quantization is None:
        return "gguf" if gguf and gguf_loader.is_quantized_file(path) else "none"
    return quantization


def load_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", tp: TPGroup | None = None,
               config: ModelConfig | None = None, quantization: str | None = None) -> LlamaForCausalLM:
    """The model in ``path`` on ``device``, in ``dtype`` (default: the checkpoint's), this rank's shard of it.

    With tensor parallelism every rank calls this with its own ``tp`` (``TPGroup.from_process_group()``).
    ``config``: ``ModelConfig.from_pretrained(path)`` already read elsewhere (e.g. by the controller), which
    spares each worker importing transformers; its dtype is ignored in favour of ``dtype``/the checkpoint's.
    ``quantization``: for a GGUF file, "gguf" keeps Q4 linear weights packed (workers/quantized_linear.py),
    "none" dequantizes everything to ``dtype``; None: "gguf" when the file is block-quantized; for a checkpoint
    directory, "q8_0" holds its matrices as Q8_0 blocks (workers/q8_weights.py).
    """
    path = os.fspath(path)
    if is_deepseek_v4(path):  # a ``config`` read by the caller is Llama-shaped: V4 reads its own
        from workers.models.deepseek_v4 import load_deepseek_v4  # own config: no Llama-shaped fields

        return load_deepseek_v4(path, dtype or checkpoint_dtype(path), device, tp)  # type: ignore[return-value]
    if config is None:
        config = ModelConfig.from_pretrained(path)  # clear errors for a missing dir / config.json
    quantization = resolve_quantization(path, quantization)
    gguf = is_gguf(path)
    config = replace(config, dtype=dtype or (torch.float32 if gguf else checkpoint_dtype(path)))
    cls = model_class_for(config)
    with torch.device(device):
        model = cls(config, tp or TPGroup.single())
    make_row_invariant(model)  # every path: a row's logits never depend on its batch (workers/kernels/)
    if not gguf:
        model.load_weights(iter_weights(path))
        if quantization == "q8_0":
            from workers.q8_weights import hold_as_q8

            hold_as_q8(model)
        return model.eval()
    weights = gguf_loader.iter_gguf_weights(path, config)
    if quantization == "gguf":
        from workers.quantized_linear import quantize_linears

        weights, model.quant_report = quantize_linears(model, weights)
        if hasattr(model.model, "set_glue"):
            model.model.set_glue()  # the layers as a few native calls each where they fit (layer_glue.py)
    model.load_weights(weights)
    return model.eval()


def is_deepseek_v4(path: str) -> bool:
    """Whether config.json declares DeepSeek-V4 (compressed attention: its own config and state)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "deepseek_v4"


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
    if is_gguf(path):
        return gguf_loader.has_gguf_tokenizer(path)
    return any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tokenizer (transformers AutoTokenizer, local files only), or None when it has none."""
    path = os.fspath(path)
    if is_gguf(path):
        return gguf_loader.load_gguf_tokenizer(path) if gguf_loader.has_gguf_tokenizer(path) else None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is actually there

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
