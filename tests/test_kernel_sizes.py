"""The row-count check (workers/kernels/row_chunks.py): a kernel is called only on row counts a probe showed give
every row the base chunk's bits, so rows stay invariant even on a kernel whose summation order changes with M;
trusting every count unchecked on such a kernel breaks it (the check is what holds the invariant)."""

from __future__ import annotations

import pytest
import torch

from workers.kernels.row_chunks import chunked_call
from workers.kernels.row_linear import KernelConfig


def _order_by_rows(weight: torch.Tensor):
    """A kernel whose rows' bits depend on M: whole base chunks (M % 8 == 0) summed in float64 and rounded once,
    other row counts summed in float32 (another order, other last bits): what BLAS's M regimes look like."""
    def kernel(chunk: torch.Tensor) -> torch.Tensor:
        if chunk.shape[0] % 8 == 0:
            return (chunk.double() @ weight.double().t()).float()  # [M, N]
        return chunk @ weight.t()  # [M, N]
    return kernel


def _rows_alone_vs_inside(config: KernelConfig, key: str) -> list[int]:
    """The row counts M at which some row of an M-row call differs from that row alone."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(96, 320, generator=g), torch.randn(70, 320, generator=g)
    alone = torch.cat([chunked_call(x[i:i + 1], w, _order_by_rows, key, config) for i in range(70)])  # [70, 96]
    return [m for m in (2, 3, 5, 9, 16, 17, 30, 64, 70)
            if not torch.equal(chunked_call(x[:m], w, _order_by_rows, key, config), alone[:m])]


def test_checked_sizes_keep_rows_invariant_on_a_kernel_that_is_not() -> None:
    assert _rows_alone_vs_inside(KernelConfig(), "order-by-rows") == []


def test_bypassing_the_check_on_that_kernel_breaks_row_invariance() -> None:
    assert _rows_alone_vs_inside(KernelConfig(check_sizes=False), "order-by-rows") != []


def test_a_kernel_whose_base_chunk_depends_on_its_neighbours_is_refused() -> None:
    """No row count of such a kernel can be trusted, so the check says so instead of running it."""
    def leaky(weight: torch.Tensor):
        return lambda chunk: chunk @ weight.t() + 1e-3 * chunk.sum()  # every row sees its chunk's sum

    w, x = torch.randn(32, 64), torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="not row-invariant even at a fixed shape"):
        chunked_call(x, w, leaky, "leaky", KernelConfig())


def test_checked_calls_match_plain_linear_for_any_row_count() -> None:
    """Padding and cutting lose no row and mix none up: every M up to past two ``max_rows`` calls."""
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(40, 48, generator=g), torch.randn(140, 48, generator=g)
    for m in range(1, 141, 7):
        got = chunked_call(x[:m], w, _order_by_rows, "order-by-rows-small", KernelConfig())
        torch.testing.assert_close(got, x[:m] @ w.t(), rtol=1e-5, atol=1e-5)
