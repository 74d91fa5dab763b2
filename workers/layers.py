"""Building blocks of the decoder models, with tensor parallelism inside them.

Every weight-holding layer knows how it is split over the ranks of its ``TPGroup`` and has a
``weight_loader(param, src, shard_id=None)`` that copies *this rank's part* of a full Hugging Face tensor into
``param``. ``src`` is either a tensor or a lazy safetensors slice (``safe_open(...).get_slice(name)``): the
loader only indexes the rows/columns it needs, so a rank never reads the whole tensor from disk.

Splits (Megatron style):
- ``ColumnParallelLinear``: output features split; each rank computes its slice of y, no communication.
  ``MergedColumnParallelLinear`` (gate+up) and ``QKVParallelLinear`` hold several such matrices in one
  weight so one matmul does them all; each rank keeps its slice of every part, laid end to end.
- ``RowParallelLinear``: input features split; partial products are summed with one all-reduce.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows split into equal ranges (the last rank
  zero-padded); lookups are all-reduced, logits all-gathered.

``source_region(shard_id)`` says which part of a full tensor a rank holds and where it goes; the weight loaders
use it, and so does workers/quantized_linear.py, which cuts a rank's packed 4-bit blocks the same way and sets
the layer's ``quant`` (a weight-only quantized matmul used instead of ``weight``, which is then dropped).

With a size-1 group each layer is a plain ``F.linear`` / ``F.embedding``: no masks, no collectives.
Parameters are created uninitialised (``torch.empty``): they are always overwritten by a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import TPGroup
from workers.kernels.row_linear import DEFAULT as DEFAULT_KERNELS
from workers.kernels.row_linear import KernelConfig, forget_packed, onednn_chunks, row_invariant_linear


class TensorSlice(Protocol):
    """What ``safetensors.safe_open(...).get_slice(name)`` returns."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


WeightSource = torch.Tensor | TensorSlice


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read_full(src: WeightSource) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src[:]


def read_narrow(src: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """``src[..., start:start+length, ...]`` along ``dim``, reading only those elements from a lazy slice."""
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, length)
    index = [slice(None)] * len(src.get_shape())
    index[dim] = slice(start, start + length)
    return src[tuple(index)]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch loading {name}: this rank expects {tuple(dst.shape)}, "
                         f"the checkpoint slice is {tuple(src.shape)}")
    dst.copy_(src)  # copy_ also converts the checkpoint dtype to the parameter dtype
    forget_packed(dst)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           row_invariant: bool = False) -> torch.Tensor:
    """``F.linear`` for x [T, in], weight [out, in] -> [T, out]; ``row_invariant``: a row's result bit-identical
    whatever the other rows (BLAS on fixed-shape row chunks, workers/kernels/row_linear.py).

    It computed (W @ x^T)^T for 2-8 rows on CPU (commit 8a511e3: MKL's small-M GEMM against a transposed weight
    had measured slow). With torch 2.13 here that orientation is the slow one: on the built-in pair's shapes
    2-8 rows took 1.2-5x F.linear's time, and a target verify of 3 tokens 16-20 ms against 10-12 ms
    (benchmarks/results/adaptive-saturation-2026-12-01/README.md). One place to change it again.
    """
    if row_invariant:
        return row_invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the rows of W (output features) split across ranks; y stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.in_features = in_features
        self.out_per_rank = divide(out_features, self.tp.size, "out_features")
        self.weight = _param(self.out_per_rank, in_features, dtype=dtype)  # [out / tp, in]
        self.bias = _param(self.out_per_rank, dtype=dtype) if bias else None
        self.quant: nn.Module | None = None  # a weight-only quantized matmul standing in for self.weight
        self.row_invariant = False  # a row's output independent of the other rows (``make_row_invariant``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)  # [T, out / tp]
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias, self.row_invariant)  # [T, out / tp]

    def source_region(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """Where this rank's part of checkpoint tensor ``shard_id`` comes from and goes: (first row of our
        weight it fills, dim of the full tensor it is cut along, start, length)."""
        n = self.out_per_rank
        return 0, 0, self.tp.rank * n, n

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        offset, dim, start, n = self.source_region(shard_id)  # a bias is cut like its weight's rows
        what = "column-parallel" if shard_id is None else f"part {shard_id} of a merged"
        _copy_into(param.data.narrow(0, offset, n), read_narrow(src, dim, start, n), f"{what} weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices with the same input (gate_proj, up_proj) in one weight.

    Rank r's weight is [part_0 rows of r; part_1 rows of r; ...]; ``shard_id`` is the part's index.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype)
        self.part_sizes = [divide(s, self.tp.size, "output size") for s in output_sizes]

    def source_region(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs the part index as shard_id")
        n = self.part_sizes[shard_id]
        return sum(self.part_sizes[:shard_id]), 0, self.tp.rank * n, n


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj, v_proj in one weight; heads are split across ranks.

    When tp size > num_kv_heads, each kv head is replicated on tp / num_kv_heads consecutive ranks, which are
    exactly the ranks holding the query heads of its group.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup | None = None, dtype: torch.dtype = torch.float32) -> None:
        tp = tp or TPGroup.single()
        self.num_heads = divide(num_heads, tp.size, "num_heads")
        if num_kv_heads % tp.size == 0:
            self.num_kv_heads = num_kv_heads // tp.size
            self.kv_head_start = tp.rank * self.num_kv_heads
        elif tp.size % num_kv_heads == 0:
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        else:
            raise ValueError(f"tensor-parallel size {tp.size} must divide num_kv_heads={num_kv_heads} or be a "
                             "multiple of it")
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        # The parent's divisibility check is on the per-rank total, so hand it the per-rank size times tp.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias, tp, dtype)

    def source_region(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        if shard_id == "q":
            return 0, 0, self.tp.rank * self.q_size, self.q_size
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            return offset, 0, self.kv_head_start * self.head_dim, self.kv_size
        raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the columns of W (input features) split; x arrives sharded, y is all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.in_per_rank = divide(in_features, self.tp.size, "in_features")
        self.weight = _param(out_features, self.in_per_rank, dtype=dtype)  # [out, in / tp]
        self.bias = _param(out_features, dtype=dtype) if bias else None  # added once, after the reduce
        self.quant: nn.Module | None = None  # a weight-only quantized matmul standing in for self.weight
        self.row_invariant = False  # a row's output independent of the other rows (``make_row_invariant``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)  # [T, out], this rank's partial sum
        elif self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.row_invariant)
        else:
            y = linear(x, self.weight, None, self.row_invariant)  # [T, out]
        if self.tp.size > 1:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def source_region(self, shard_id: Any = None) -> tuple[int, int, int, int]:
        """(first row filled, dim cut along, start, length): this rank's input columns, every output row."""
        n = self.in_per_rank
        return 0, 1, self.tp.rank * n, n

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if param is self.bias:
            _copy_into(param.data, read_full(src), "row-parallel bias")
            return
        _, dim, start, n = self.source_region(shard_id)
        _copy_into(param.data, read_narrow(src, dim, start, n), "row-parallel weight")


def make_row_invariant(model: nn.Module, config: KernelConfig = DEFAULT_KERNELS) -> None:
    """Give every row of ``model``'s forwards the same bits whatever shares its batch (workers/kernels/): its
    float linear layers chunk their BLAS calls, and ``model.row_invariant`` asks for the row-invariant head and
    per-row attention."""
    model.row_invariant = True
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.row_invariant = True
        elif isinstance(m, ParallelLMHead):
            # oneDNN's chunk reads a big head once for all its rows (as fast as one gemv at one row): chunks
            big = m.weight.numel() * m.weight.element_size() > config.head_gemv_bytes
            m.head_gemv = big and not onednn_chunks(m.weight, config)


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its rows split into equal contiguous vocabulary ranges, one per rank."""

    def __init__(self, vocab_size: int, embed_dim: int, tp: TPGroup | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / self.tp.size)
        self.vocab_start = self.tp.rank * self.rows_per_rank
        # Rows this rank really owns; the rest (last rank only) is zero padding so all ranks gather equal shapes.
        self.num_owned = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = _param(self.rows_per_rank, embed_dim, dtype=dtype)  # [ceil(V / tp), E]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # [T, E]
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_owned)  # [T]
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)  # other ranks contribute these rows
        return self.tp.all_reduce(out)  # [T, E]

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        rows = source_shape(src)[0]
        if rows != self.vocab_size:
            raise ValueError(f"embedding has {rows} rows in the checkpoint, config says vocab_size="
                             f"{self.vocab_size}")
        param.data[self.num_owned:].zero_()
        if self.num_owned:
            _copy_into(param.data[:self.num_owned], read_narrow(src, 0, self.vocab_start, self.num_owned),
                       "vocabulary shard")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding (so a tied head can share its weight)."""

    # Row-invariant logits as one gemv per row (big, memory-bound heads) or through fixed-shape chunks
    # (``make_row_invariant`` picks by size: ``KernelConfig.head_gemv_bytes``).
    head_gemv = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use ParallelLMHead.logits(hidden)")

    def logits(self, hidden: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """[N, E] -> [N, V] float32 over the full vocabulary (gathered from every rank); ``row_invariant``: a
        row's logits bit-identical whatever the other rows (a gemv per row, workers/row_invariant.py, or
        fixed-shape chunks, workers/kernels/row_linear.py: ``head_gemv``)."""
        if row_invariant and self.head_gemv:
            from workers.row_invariant import row_invariant_logits

            local = row_invariant_logits(hidden, self.weight)  # [N, ceil(V / tp)]
        elif row_invariant:
            local = row_invariant_linear(hidden, self.weight)  # [N, ceil(V / tp)]
        else:
            local = linear(hidden, self.weight)  # [N, ceil(V / tp)]
        if self.tp.size == 1:
            return local.float()
        return self.tp.all_gather(local, dim=-1)[:, :self.vocab_size].float()


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 whatever the weights' dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        # The native norm of workers/kernels/layer_glue.py (float32), set with a model's glued layers so that
        # every path through the model computes the same bits (``LlamaModel.set_glue``).
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:  # workers.kernels.layer_glue.add_rms_norm (the library is loaded: the glue chose it)
            normed = torch.ops.specserve_gguf.add_rms_norm(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[1]
            return normed.view(x.shape)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused call with the very same float32 arithmetic as below (bit-identical), minus ~6 op dispatches.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before scaling, in the order transformers uses, so half-precision results match it.
        return self.weight * x32.to(x.dtype)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        _copy_into(param.data, read_full(src), "norm weight")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for plain RoPE and the supported scaled variants."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # dynamic NTK equals plain RoPE up to max_position_embeddings, where ModelConfig caps the context.
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor  # same as dividing positions by factor
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths (beyond the original context / low_freq_factor) are slowed by `factor`,
        # short ones (below original / high_freq_factor) kept, and the band in between interpolated.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        between = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(between, interpolated, out)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama layout) at arbitrary per-token positions.

    cos/sin are computed per forward from the positions (one [T, D/2] outer product) instead of a table, so
    any position works — tree nodes share positions with their siblings — and no max-length table is kept.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        half = head_dim // 2
        self.register_buffer("sign", torch.tensor([-1.0] * half + [1.0] * (head_dim - half)), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, D] float32, shared by every layer (and head) of one forward.

        The signed sin has its first half negated, which lets ``apply_rotary`` rotate with one ``roll``.
        """
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().unsqueeze(1), (emb.sin() * self.sign).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/signed sin [T, 1, D] (``RotaryEmbedding``) -> x rotated, in x's dtype (computed in float32).

    Transformers' ``x * cos + cat(-x2, x1) * sin`` exactly: ``roll`` gives cat(x2, x1), and ``x2 * -s`` is
    ``-x2 * s`` bit for bit.
    """
    x32 = x if x.dtype == torch.float32 else x.float()
    out = x32 * cos + x32.roll(x32.shape[-1] // 2, -1) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
