"""The native GGUF block kernel (workers/kernels/gguf_blocks.py), with float32 activations ("f32") and with
activations quantized per row and 32-block to 8 bits ("q8", gguf_q8.cpp): exact block decoding, values against a
float64 reference, and row invariance by construction (a row of an M-row call == that row alone, bit for bit, at 1
and 2 threads, on every instruction-set path), shown to catch a deliberately M-dependent variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.kernels import gguf_blocks

pytestmark = pytest.mark.skipif(not gguf_blocks.available(),
                                reason="the native GGUF kernel did not build or pass its check here (no C++ "
                                       "compiler?): the engine runs torch's path")

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
MODES = ["f32", "q8"]


def isas(mode: str) -> list[str]:
    if mode == "q8":
        return gguf_blocks.q8_isas()
    best = gguf_blocks.ISA[gguf_blocks.best_isa()]
    return [name for name in ("scalar", "avx2", "avx512") if gguf_blocks.ISA[name] <= best]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, isa: str, mode: str) -> torch.Tensor:
    if mode == "q8":
        return gguf_blocks.block_matmul_q8(x, gguf_blocks.pack_q8(blocks, qtype), qtype, blocks.shape[0], isa)
    return gguf_blocks.block_matmul(x, blocks, qtype, isa)


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


def test_activations_are_quantized_as_llama_cpp_does() -> None:
    """d = max|x| / 127 rounded to float16, q = round-half-even(x / d): the kernel's against torch ops."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 96, generator=g) * torch.pow(2.0, torch.randint(-6, 7, (6, 96), generator=g).float())
    x[2, 32:64] = 0  # an all-zero block: d = 0, q = 0
    q, d = gguf_blocks.quantize_activations(x)
    assert q.abs().max() <= 127 and torch.equal(q[2, 32:64], torch.zeros(32, dtype=torch.int8))
    dq = (q.float().reshape(6, 3, 32) * d[..., None]).reshape(6, 96)
    assert torch.equal(dq, gguf_blocks.quantize_activations_reference(x))
    step = x.reshape(6, 3, 32).abs().amax(-1, keepdim=True) / 127  # [6, 3, 1]: d before its float16 rounding
    assert ((dq - x).reshape(6, 3, 32).abs() <= 0.6 * step).all()  # half a step, + the float16 scale's rounding


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_matmul_equals_a_float64_reference_on_every_path(name: str, mode: str) -> None:
    blocks, w = file_blocks(name, 70, 576, seed=1)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    xa = gguf_blocks.quantize_activations_reference(x) if mode == "q8" else x  # the activations the kernel uses
    ref = xa.double() @ torch.from_numpy(w).double().t()  # [9, 70]
    scalar = matmul(x, blocks, gguf_blocks.QTYPES[name], "scalar", mode)
    for isa in isas(mode):
        y = matmul(x, blocks, gguf_blocks.QTYPES[name], isa, mode)
        torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-5)
        assert torch.equal(y, scalar), f"{isa} sums in another order than the scalar path"


def row_dependence(isa: str, qtype: int, threads: int, mode: str = "f32") -> list[int]:
    """The row counts M in 1..17 at which some row of an M-row call differs from the same row alone."""
    blocks = gguf_blocks.random_blocks(102, 576, qtype, seed=3)  # N = 102: whole 4-row passes and a tail
    g = torch.Generator().manual_seed(4)
    x = torch.randn(17, 576, generator=g) * torch.pow(2.0, torch.randint(-8, 9, (17, 576), generator=g).float())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([matmul(x[i:i + 1], blocks, qtype, isa, mode) for i in range(17)])
        bad = []
        for m in range(1, 18):
            for start in {0, 17 - m}:  # the rows at the start and at the end of the 17
                if not torch.equal(matmul(x[start:start + m], blocks, qtype, isa, mode), alone[start:start + m]):
                    bad.append(m)
                    break
        return bad
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", FORMATS)
def test_a_row_of_an_m_row_call_equals_the_row_alone(name: str, threads: int, mode: str) -> None:
    for isa in isas(mode):
        assert row_dependence(isa, gguf_blocks.QTYPES[name], threads, mode) == [], isa


@pytest.mark.parametrize("mode", MODES)
def test_an_m_dependent_reduction_is_caught(mode: str) -> None:
    """The check above fails on the kernel's test-only variant that sums in another order when M > 1."""
    assert row_dependence("skewed", gguf_blocks.QTYPES["Q4_1"], 1, mode) == list(range(2, 18))
