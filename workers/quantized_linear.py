"""Weight-only matmuls for GGUF block weights, kept packed in memory (``--quantization gguf``).

Two kernels. The native one (``BlockLinear``, workers/kernels/gguf_blocks.py) reads Q4_0 / Q4_1 / Q8_0 in the
file's own blocks with float32 activations and accumulation, reads each weight row once for all rows of a call,
and is row-invariant by construction; it is used when it builds and passes its check on this machine, on the CPU,
and ``KernelConfig.gguf_native`` holds (``SPECSERVE_GGUF_KERNEL=0`` also turns it off); its activations are
float32 or, with ``KernelConfig.gguf_activations = "q8"`` (``SPECSERVE_GGUF_ACTIVATIONS``) on an AVX-512 VNNI CPU,
quantized per 32-block to 8 bits as llama.cpp computes these formats (the 4-bit target then computes as llama.cpp
does; the default where VNNI exists, docs/performance.md says why). With it the tied
embedding / head stays in blocks too (workers/quantized_head.py). Otherwise (no compiler, a GPU, switched off),
torch's int4 kernel below, which is what the rest of this docstring describes.

A batch-1 decode step is memory-bound: every weight byte is read once per step, so a 4-bit weight is read in
about 1/7 of the time of its float32 expansion (Q4_1 stores 20 bytes per 32 weights). The matmul is torch's
CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``), which computes per 32-weight group g and row n

    w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]          q in 0..15

so Q4_0 (w = (q - 8) d) is scale = d, zero = 0 and Q4_1 (w = q d + m) is scale = d, zero = m + 8 d.

What this model computes, and why it is a model of its own rather than the float32 one: the kernel is fast
only for bfloat16 (float32 inputs take a scalar path ~40x slower here), so the activations entering these
matmuls, the block scales (float16 in the file) and the outputs are rounded to bfloat16; everything else
(norms, residual stream, attention, the head) stays in the compute dtype. The kernel gives a row the same
result whatever the other rows of the batch (tests/test_gguf.py, tests/test_row_invariance.py); float32 GEMM
and SDPA do not, and bfloat16 rounding turns their 1e-7 differences into flipped tokens, so the loader marks a
quantized model ``row_invariant`` (head and attention per row, workers/row_invariant.py): verification of k+1
rows then scores each candidate as a one-row decode step would, and speculation reproduces this model's output.

``quantize_linears(model, weights)`` moves every Q4 weight of a column/row-parallel linear layer into an
``Int4Linear`` (this rank's rows/columns only, cut with the layer's ``source_region``) and returns the
weights still to be loaded the ordinary way. Shapes the kernel cannot take (output rows not a multiple of 16,
a rank's input columns not whole 32-weight groups) stay dequantized, and the returned report says which.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from workers.kernels import gguf_blocks
from workers.kernels.row_linear import DEFAULT as DEFAULT_KERNELS
from workers.kernels.row_linear import KernelConfig
from workers.layers import ColumnParallelLinear, RowParallelLinear
from workers.quantized_head import native_qtype, quantize_head, raw_blocks

log = logging.getLogger(__name__)

GROUP = 32  # weights per Q4_0 / Q4_1 block
_KERNEL_DTYPE = torch.bfloat16
_INNER_K_TILES = 2


def _q4_types() -> dict[Any, int]:
    """GGML type -> bytes before the nibbles in a block (Q4_0: d; Q4_1: d, m)."""
    from gguf import GGMLQuantizationType as T

    return {T.Q4_0: 2, T.Q4_1: 4}


def decode_q4_blocks(raw: np.ndarray, qtype: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [N, K/32 * block bytes] -> nibbles q [N, K] int32, scale [N, K/32], zero [N, K/32] (float32)."""
    head = _q4_types()[qtype]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, head + GROUP // 2)  # [N, G, bytes]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]  # [N, G]
    nibbles = blocks[..., head:]  # [N, G, 16]: low nibble = weight j, high nibble = weight j + 16
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)  # [N, K]
    if head == 4:  # Q4_1: w = q d + m
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        zero = m + 8 * d
    else:  # Q4_0: w = (q - 8) d
        zero = np.zeros_like(d)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


class Int4Linear(nn.Module):
    """y = x W^T with W held as packed 4-bit groups; x [T, in] in any float dtype, y [T, out] in x's dtype."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES))
        # [K/32, N, 2]: the kernel's layout of (scale, zero) per group and output row
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], -1).to(_KERNEL_DTYPE).contiguous())

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % 16 == 0 and in_features % GROUP == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(_KERNEL_DTYPE).contiguous(), self.packed, GROUP,
                                                        self.scales_zeros)  # [T, out]
        return y.to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


class BlockLinear(nn.Module):
    """y = x W^T with W held as the file's blocks [out, in / 32 * block bytes] uint8 (the native kernel); x [T, in]
    in any float dtype (computed in float32, or quantized to 8 bits per 32-block: ``activations`` "q8", the
    blocks then held repacked for it), y [T, out] in x's dtype."""

    def __init__(self, blocks: torch.Tensor, qtype: int, activations: str = "f32") -> None:
        super().__init__()
        self.qtype, self.activations = qtype, activations
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // gguf_blocks.BLOCK_BYTES[qtype] * GROUP
        self.register_buffer("blocks", gguf_blocks.pack_q8(blocks, qtype) if activations == "q8" else blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gguf_blocks.held_matmul(x.float().contiguous(), self.blocks, self.qtype, self.out_features,
                                    self.activations)  # [T, out]
        return y.to(x.dtype)

    def nbytes(self) -> int:
        return self.blocks.numel()


def use_native(model: nn.Module, config: KernelConfig = DEFAULT_KERNELS) -> bool:
    """Whether ``model``'s block weights go through the native kernel (CPU, switched on, built and checked)."""
    params = list(model.parameters())
    on_cpu = not params or params[0].device.type == "cpu"
    return config.gguf_native and on_cpu and gguf_blocks.available()


@functools.lru_cache(maxsize=4)
def _q8_runs_here(wanted: str) -> bool:
    if wanted == "q8" and gguf_blocks.best_isa() != "avx512vnni":
        log.warning("8-bit GGUF activations need AVX-512 VNNI, which this CPU lacks: using float32 activations")
        return False
    return wanted == "q8"


def activations(config: KernelConfig = DEFAULT_KERNELS) -> str:
    """The native kernel's activation mode here: ``SPECSERVE_GGUF_ACTIVATIONS`` or the config's, "q8" only on a
    CPU with AVX-512 VNNI (call after ``use_native``)."""
    wanted = os.environ.get("SPECSERVE_GGUF_ACTIVATIONS") or config.gguf_activations
    if wanted not in ("f32", "q8"):
        raise ValueError(f"SPECSERVE_GGUF_ACTIVATIONS must be 'f32' or 'q8', got {wanted!r}")
    return "q8" if _q8_runs_here(wanted) else "f32"


@dataclass
class QuantReport:
    quantized: list[str] = field(default_factory=list)  # module names now running BlockLinear / Int4Linear
    dequantized: list[str] = field(default_factory=list)  # Q4 weights expanded because the kernel cannot take them
    packed_bytes: int = 0
    native: bool = False  # the native block kernel (BlockLinear and the block-held embedding / head)
    activations: str = "f32"  # the native kernel's activations ("f32" / "q8", KernelConfig.gguf_activations)


def _rank_blocks(layer: nn.Module, parts: Sequence[tuple[Any, Any]]) -> np.ndarray | None:
    """This rank's raw Q4 rows of ``layer``'s weight (all parts end to end), or None when not block-aligned."""
    pieces = []
    for shard_id, src in parts:
        offset, dim, start, length = layer.source_region(shard_id)
        if dim == 0:
            pieces.append((offset, src.raw_rows(start, length)))
            continue
        if start % GROUP or length % GROUP:
            return None
        bpb = src.raw_rows(0, 1).shape[1] // (src.get_shape()[1] // GROUP)  # bytes per block
        rows = src.raw_rows(0, src.get_shape()[0])
        pieces.append((offset, rows[:, start // GROUP * bpb:(start + length) // GROUP * bpb]))
    pieces.sort(key=lambda p: p[0])
    return np.concatenate([p for _, p in pieces], axis=0)


def quantize_linears(model: nn.Module, weights: list[tuple[str, Any]],
                     config: KernelConfig = DEFAULT_KERNELS) -> tuple[list[tuple[str, Any]], QuantReport]:
    """Put block-quantized linear weights into ``BlockLinear`` (native kernel) or Q4 ones into ``Int4Linear``
    modules, and with the native kernel the embedding / head into blocks; returns (weights left for
    ``load_weights``, report).

    ``weights``: (HF name, ``GGUFSource``); ``model.route_weight`` maps names to our parameters.
    """
    report = QuantReport(native=use_native(model, config))
    if report.native:
        report.activations = activations(config)
        weights, report.packed_bytes = quantize_head(model, weights, report.activations)
        kinds = {src.qtype for _, src in weights if native_qtype(src) is not None}  # formats the kernel reads
    else:
        kinds = set(_q4_types())
    modules = dict(model.named_modules())
    groups: dict[str, list[tuple[str, Any, Any]]] = {}  # module name -> [(hf name, shard id, source)]
    for hf_name, src in weights:
        routed = model.route_weight(hf_name)
        if routed is None or getattr(src, "qtype", None) not in kinds or not routed[0].endswith(".weight"):
            continue
        module_name = routed[0].rpartition(".")[0]
        if isinstance(modules.get(module_name), (ColumnParallelLinear, RowParallelLinear)):
            groups.setdefault(module_name, []).append((hf_name, routed[1], src))
    taken: set[str] = set()
    for module_name, parts in groups.items():
        layer = modules[module_name]
        if len({src.qtype for _, _, src in parts}) != 1:
            report.dequantized.append(module_name)
            continue
        raw = _rank_blocks(layer, [(sid, src) for _, sid, src in parts])
        out_rows, in_cols = layer.weight.shape
        if raw is None or not (report.native or Int4Linear.fits(out_rows, in_cols)):
            report.dequantized.append(module_name)
            continue
        if report.native:
            layer.quant = BlockLinear(raw_blocks(raw), native_qtype(parts[0][2]), report.activations)
        else:
            q, scale, zero = decode_q4_blocks(raw, parts[0][2].qtype)
            layer.quant = Int4Linear(q, scale, zero).to(layer.weight.device)
        layer.weight = None  # no float copy of the weight is kept
        report.quantized.append(module_name)
        report.packed_bytes += layer.quant.nbytes()
        taken.update(hf for hf, _, _ in parts)
    return [(n, s) for n, s in weights if n not in taken], report
