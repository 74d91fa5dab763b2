"""``x @ W^T`` for float32 / bfloat16 weights, each row's result independent of the other rows of the call.

BLAS picks its kernel, blocking and (for small M) its whole algorithm from the shape: MKL's float32 GEMM sums a
row in one order at M = 1 (a gemv), another at 2-15 and another at 16+. Here BLAS only ever sees one shape per
weight, [rows, K] x [K, N] (``KernelConfig.gemm_rows``), on a fresh contiguous copy of the rows (so the operand
alignment is fixed too: MKL's results may depend on it), the last chunk padded with zeros. A fixed shape is a
fixed kernel: each output element is a dot product summed in the same order whatever the other rows hold or
where the row sits among them (tests/test_row_invariance.py checks both, for every M the engine makes).

Cost: a decode step computes ``gemm_rows`` rows where it needs one; the extra rows of a verify up to
``gemm_rows`` are then free (the weight is read once per chunk).

float32 on a CPU with oneDNN goes through oneDNN's linear on a weight packed once for ``gemm_rows`` rows (its
blocked layout, kept beside the parameter and repacked when the parameter is written: ``Tensor._version``): the
same fixed-shape rule, ~1.3-1.5x faster than MKL's GEMM on those shapes (measured on the built-in pair's and the
SmolLM2 draft's layers). bfloat16, CUDA, and anything that needs gradients take ``torch.mm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    # Rows per BLAS call (float32 / bfloat16 linear layers). Larger: more rows share one read of the weight, a
    # one-row decode step pays more padded compute. 8 measured as a 1.5-3.5x one-row GEMM and ~1x for 2-8 rows.
    gemm_rows: int = 8
    # Without oneDNN, output heads above this size are one gemv per row over cache-sized slices instead
    # (workers/row_invariant.py): a big head is memory-bound, so MKL's padded chunks cost ~2x a gemv at one row; a
    # small one is compute-bound, so chunks are far cheaper than a gemv per row at batch (measured 4x on the
    # built-in 4096 x 320 head, 32 rows). oneDNN's chunks cost one gemv at one row (SmolLM2's 49,152 x 576 head:
    # 10.0 ms vs 10.6, and 10.1 ms for 5 rows vs 50 as gemvs), so with oneDNN every head takes chunks.
    head_gemv_bytes: int = 32 * 2**20
    # float32 on CPU through oneDNN's linear on a weight packed for ``gemm_rows`` rows: faster chunks, at the
    # price of a packed copy of every float32 weight (the parameter itself is kept for loading and TP slicing).
    onednn: bool = True

    def __post_init__(self) -> None:
        if self.gemm_rows < 1 or self.head_gemv_bytes < 0:
            raise ValueError(f"gemm_rows must be >= 1 and head_gemv_bytes >= 0, got {self.gemm_rows}, "
                             f"{self.head_gemv_bytes}")


DEFAULT = KernelConfig()


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N] in x's dtype, BLAS called on [rows, K] chunks only."""
    t, k = x.shape
    if t == 0:
        return x.new_empty(0, weight.shape[0])  # [0, N]
    rows = config.gemm_rows
    chunks = -(-t // rows)
    padded = x.new_zeros(chunks * rows, k)  # [C * rows, K]: fresh, so aligned like every other call's operand
    padded[:t] = x
    mm = _packed_mm(weight, rows) if onednn_chunks(weight, config) and _onednn_ok(x, weight) else None
    if mm is not None:
        out = torch.cat([mm(padded[c * rows:(c + 1) * rows]) for c in range(chunks)])[:t]  # [T, N]
        return out if bias is None else out + bias
    wt = weight.t()  # [K, N] (a view: the orientation F.linear hands MKL)
    if chunks == 1:
        out = torch.mm(padded, wt)[:t]  # [T, N]
    else:
        aligned = rows * k * x.element_size() % 64 == 0  # each chunk's view starts on a 64-byte boundary
        parts = [padded[c * rows:(c + 1) * rows] for c in range(chunks)]  # [rows, K] each
        out = torch.cat([torch.mm(p if aligned else p.clone(), wt) for p in parts])[:t]
    return out if bias is None else out + bias


def onednn_chunks(weight: torch.Tensor, config: KernelConfig = DEFAULT) -> bool:
    """Whether ``row_invariant_linear`` runs ``weight``'s chunks through oneDNN (float32 on a CPU with oneDNN)."""
    return (config.onednn and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def _onednn_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The input matches (float32 on the CPU) and no gradient is asked for (oneDNN's op has none)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _packed_mm(weight: torch.Tensor, rows: int):
    """``chunk [rows, K] -> [rows, N]`` through oneDNN on ``weight`` packed for ``rows`` rows; the packed copy is
    cached on the parameter and rebuilt when the parameter changed since (loading writes it in place)."""
    # An inference-mode tensor has no version counter; the loaders' writes also drop the copy (``forget_packed``).
    key = (None if weight.is_inference() else weight._version, weight.data_ptr(), rows)
    cached = getattr(weight, "_specserve_packed", None)
    if cached is None or cached[0] != key:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)  # oneDNN's blocked layout
        cached = (key, packed)
        weight._specserve_packed = cached
    packed = cached[1]
    return lambda chunk: torch.ops.mkldnn._linear_pointwise(chunk, packed, None, "none", [], "")


def forget_packed(weight: torch.Tensor) -> None:
    """Drop ``weight``'s packed copy: called where a loader writes the parameter (in inference mode too)."""
    if getattr(weight, "_specserve_packed", None) is not None:
        weight._specserve_packed = None
