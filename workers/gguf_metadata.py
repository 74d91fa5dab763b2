"""What a GGUF file (llama.cpp's format) says about its model, read with the ``gguf`` package.

``gguf_model_fields(path)`` gives ``ModelConfig``'s fields from the metadata (``{arch}.block_count``, ...);
``workers/model_config.py`` builds the config from them, and ``workers/gguf_loader.py`` reads the weights.
This module knows nothing of either, so the config can dispatch to it without an import cycle.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

GGUF_SUFFIX = ".gguf"
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).endswith(GGUF_SUFFIX) and os.path.isfile(path)


@functools.lru_cache(maxsize=4)
def _reader_cached(path: str, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader  # parses every metadata field (the 49k-token vocabulary too): seconds

    return GGUFReader(path)


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """The file's ``GGUFReader``, parsed once per process (tensors stay memory-mapped)."""
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    return _reader_cached(path, st.st_mtime_ns, st.st_size)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_fields(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``ModelConfig``'s fields from the metadata; the dtype is float32 (weights are dequantized to it at load)."""
    r = gguf_reader(path)
    arch = _field(r, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{os.fspath(path)!r}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in r.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError("this GGUF stores per-frequency RoPE factors (rope_freqs, Llama 3.1 style), which are "
                         "not supported for GGUF files; use the Hugging Face checkpoint")

    def need(key: str) -> Any:
        value = _field(r, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{os.fspath(path)!r}: GGUF metadata has no {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(_field(r, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rope_dims}, head_dim={head_dim}) "
                         "are not supported")
    scaling_type = _field(r, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    else:
        raise ValueError(f"GGUF rope.scaling.type {scaling_type!r} is not supported (none, linear)")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(r, f"{arch}.vocab_size", 0) or (len(tokens.data) if tokens is not None else 0))
    eos = [int(v) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                            "tokenizer.ggml.eom_token_id") if (v := _field(r, k)) is not None]
    return dict(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(r, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensors,  # llama.cpp omits the head when it is tied
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        pad_token_id=_field(r, "tokenizer.ggml.padding_token_id"),
        dtype=torch.float32,
    )
