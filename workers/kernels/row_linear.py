"""``x @ W^T`` for float32 / bfloat16 weights, each row's result independent of the other rows of the call.

BLAS picks its kernel, blocking and (for small M) its whole algorithm from the shape: MKL's float32 GEMM sums a
row in one order at M = 1 (a gemv), another at 2-15 and another at 16+. Here BLAS only ever sees row counts that
a probe has shown to give every row the bits of one base shape, [gemm_rows, K] x [K, N] (workers/kernels/
row_chunks.py: checked per kernel, weight shape, dtype and thread count on first use), on a fresh contiguous
copy of the rows (so the operand alignment is fixed too: MKL's results may depend on it), zero-padded up to an
admitted size. Each output element is then summed in the same order whatever the other rows hold or where the
row sits among them (tests/test_row_invariance.py checks both, for every M the engine makes).

Cost: where every row count is admitted (oneDNN on the shipped shapes with K <= 960) a call is one whole-M call,
as plain ``F.linear``; where only the base is, a decode step computes ``gemm_rows`` rows where it needs one and
an M-row step makes M / gemm_rows calls.

float32 on a CPU with oneDNN goes through oneDNN's linear on a weight packed once for ``gemm_rows`` rows (its
blocked layout, kept beside the parameter and repacked when the parameter is written: ``Tensor._version``),
~1.3-1.5x faster than MKL's GEMM on those shapes (measured on the built-in pair's and the SmolLM2 draft's
layers). bfloat16, CUDA, and anything that needs gradients take ``torch.mm`` through the same checked sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.kernels.row_chunks import chunked_call


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
    # Most rows in one call; more rows are cut into calls of this size. Larger: fewer calls for big batches and
    # prompt chunks, more sizes to probe (one call each, on first use). A multiple of ``gemm_rows``.
    max_rows: int = 64
    # Call only row counts a probe showed give the base chunk's bits (workers/kernels/row_chunks.py). False
    # trusts every size unchecked: only for showing what the check prevents.
    check_sizes: bool = True
    # GGUF block weights (Q4_0 / Q4_1 / Q8_0) through the native row-invariant kernel (workers/kernels/
    # gguf_blocks.py) when it builds here; False: torch's int4 kernel (bfloat16 activations) and a float32 head.
    gguf_native: bool = True
    # The native kernel's activations: "q8" quantizes them per row and 32-block to 8 bits and takes integer dot
    # products against the blocks, as llama.cpp computes these formats (on AVX-512 VNNI a 4-bit step costs ~0.6x
    # and a 5-row verify ~0.55x "f32"'s, but it is another model: greedy text drifts from "f32"'s after some
    # tokens); "f32": float32 activations, exact products (docs/performance.md, "Verify cost"). "q8" needs AVX-512
    # VNNI, else "f32" is used (logged once); ``SPECSERVE_GGUF_ACTIVATIONS`` overrides. "q8" by default: the file's
    # own reference engine computes this way, and a q8 5-row verify costs less than an f32 one-row step.
    gguf_activations: str = "q8"

    def __post_init__(self) -> None:
        if self.gguf_activations not in ("f32", "q8"):
            raise ValueError(f"gguf_activations must be 'f32' or 'q8', got {self.gguf_activations!r}")
        if self.gemm_rows < 1 or self.head_gemv_bytes < 0 or self.max_rows % self.gemm_rows:
            raise ValueError(f"gemm_rows must be >= 1, head_gemv_bytes >= 0 and max_rows a multiple of gemm_rows, "
                             f"got {self.gemm_rows}, {self.head_gemv_bytes}, {self.max_rows}")


DEFAULT = KernelConfig()


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N] in x's dtype, BLAS called on checked row counts only."""
    t, k = x.shape
    if t == 0:
        return x.new_empty(0, weight.shape[0])  # [0, N]
    if onednn_chunks(weight, config) and _onednn_ok(x, weight):
        out = chunked_call(x, weight, lambda w: _packed_mm(w, config.gemm_rows), "onednn", config)  # [T, N]
    else:
        out = chunked_call(x, weight, _mm, "mm", config)  # [T, N]
    return out if bias is None else out + bias


def _mm(weight: torch.Tensor):
    """``chunk [rows, K] -> [rows, N]`` through ``torch.mm`` (MKL on a CPU, cuBLAS on a GPU)."""
    wt = weight.t()  # [K, N] (a view: the orientation F.linear hands MKL)
    return lambda chunk: torch.mm(chunk, wt)


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
