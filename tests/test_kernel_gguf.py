"""The native GGUF block kernel (workers/kernels/gguf_blocks.py): exact block decoding, values against a float64
reference, and row invariance by construction (a row of an M-row call == that row alone, bit for bit, at 1 and 2
threads, on every instruction-set path), shown to catch a deliberately M-dependent variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.kernels import gguf_blocks

pytestmark = pytest.mark.skipif(not gguf_blocks.available(),
                                reason="the native GGUF kernel did not build or pass its check here (no C++ "
                                       "compiler?): the engine runs torch's path")

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def isas() -> list[str]:
    best = gguf_blocks.ISA[gguf_blocks.best_isa()]
    return [name for name in ("scalar", "avx2", "avx512") if gguf_blocks.ISA[name] <= best]


def file_blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Blocks as gguf's own quantizer writes them [N, bytes] uint8, and gguf's dequantization [N, K] float32."""
    import gguf

    t = gguf.GGMLQuantizationType[name]
    raw = gguf.quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), t)
    return torch.from_numpy(np.ascontiguousarray(raw)), gguf.dequantize(raw, t).reshape(n, k)


@pytest.mark.parametrize("name", FORMATS)
def test_block_decoding_matches_gguf_dequantize(name: str) -> None:
    blocks, expected = file_blocks(name, 37, 96)
    qtype = gguf_blocks.QTYPES[name]
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(gguf_blocks.block_rows(blocks, ids, qtype), torch.from_numpy(expected)[ids])
    assert torch.equal(gguf_blocks.dequantize_reference(blocks, qtype), torch.from_numpy(expected))


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_equals_a_float64_reference_on_every_path(name: str) -> None:
    blocks, w = file_blocks(name, 70, 576, seed=1)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ torch.from_numpy(w).double().t()  # [9, 70]
    scalar = gguf_blocks.block_matmul(x, blocks, gguf_blocks.QTYPES[name], "scalar")
    for isa in isas():
        y = gguf_blocks.block_matmul(x, blocks, gguf_blocks.QTYPES[name], isa)
        torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-5)
        assert torch.equal(y, scalar), f"{isa} sums in another order than the scalar path"


def row_dependence(isa: str, qtype: int, threads: int) -> list[int]:
    """The row counts M in 1..17 at which some row of an M-row call differs from the same row alone."""
    blocks = gguf_blocks.random_blocks(102, 576, qtype, seed=3)  # N = 102: whole 4-row passes and a tail
    g = torch.Generator().manual_seed(4)
    x = torch.randn(17, 576, generator=g) * torch.pow(2.0, torch.randint(-8, 9, (17, 576), generator=g).float())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([gguf_blocks.block_matmul(x[i:i + 1], blocks, qtype, isa) for i in range(17)])
        bad = []
        for m in range(1, 18):
            for start in {0, 17 - m}:  # the rows at the start and at the end of the 17
                if not torch.equal(gguf_blocks.block_matmul(x[start:start + m], blocks, qtype, isa),
                                   alone[start:start + m]):
                    bad.append(m)
                    break
        return bad
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", FORMATS)
def test_a_row_of_an_m_row_call_equals_the_row_alone(name: str, threads: int) -> None:
    for isa in isas():
        assert row_dependence(isa, gguf_blocks.QTYPES[name], threads) == [], isa


def test_an_m_dependent_reduction_is_caught() -> None:
    """The check above fails on the kernel's test-only variant that sums lanes in another order when M > 1."""
    assert row_dependence("skewed", gguf_blocks.QTYPES["Q4_1"], 1) == list(range(2, 18))
