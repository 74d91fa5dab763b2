"""Without the native GGUF kernel (no compiler, or switched off) the engine says so once and loads torch's path."""

from __future__ import annotations

import logging

import pytest

from tests.helpers_gguf import hf_to_gguf
from tests.helpers_models import make_tiny_checkpoint
from workers.kernels import gguf_blocks
from workers.loader import load_model
from workers.quantized_head import BlockHead
from workers.quantized_linear import Int4Linear


@pytest.fixture
def fresh_kernel_state():
    gguf_blocks.available.cache_clear()
    yield
    gguf_blocks.available.cache_clear()


def test_a_missing_compiler_is_reported_once(monkeypatch, tmp_path, caplog, fresh_kernel_state) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=gguf_blocks.__name__):
        assert not gguf_blocks.available()
        assert not gguf_blocks.available()
    warnings = [r for r in caplog.records if "GGUF block kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_switched_off_the_model_runs_torch_int4_path(monkeypatch, tmp_path, fresh_kernel_state) -> None:
    path = hf_to_gguf(make_tiny_checkpoint(tmp_path / "hf", family="llama"), tmp_path / "m.gguf", "Q4_1")
    monkeypatch.setenv("SPECSERVE_GGUF_KERNEL", "0")
    model = load_model(path)
    assert not model.quant_report.native and model.quant_report.quantized
    quants = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    assert quants and all(isinstance(q, Int4Linear) for q in quants)
    assert not isinstance(model.lm_head, BlockHead)


def test_q8_activations_load_and_keep_rows_invariant(monkeypatch, tmp_path, fresh_kernel_state) -> None:
    """``SPECSERVE_GGUF_ACTIVATIONS=q8`` (KernelConfig.gguf_activations): the tiny Q4_1 model's linears and head run
    the 8-bit-activation kernel, and a row of its batch still equals the row alone."""
    from tests.test_row_invariance import _invariance_failures
    from workers.quantized_linear import BlockLinear

    if not gguf_blocks.available() or gguf_blocks.best_isa() != "avx512vnni":
        pytest.skip("8-bit activations need the native kernel and AVX-512 VNNI")
    monkeypatch.setenv("SPECSERVE_GGUF_ACTIVATIONS", "q8")
    hf = make_tiny_checkpoint(tmp_path / "hf", family="llama", vocab_size=128, seed=3, head_dim=16,
                              num_attention_heads=4, num_key_value_heads=2)
    model = load_model(hf_to_gguf(hf, tmp_path / "tiny-q4_1.gguf", "Q4_1"))
    assert model.quant_report.activations == "q8" and model.lm_head.activations == "q8"
    quants = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    assert quants and all(isinstance(q, BlockLinear) and q.activations == "q8" for q in quants)
    assert _invariance_failures(model) == []


def test_without_vnni_q8_falls_back_to_f32_once(monkeypatch, caplog) -> None:
    from workers import quantized_linear

    monkeypatch.setattr(gguf_blocks, "best_isa", lambda: "avx512")
    monkeypatch.setenv("SPECSERVE_GGUF_ACTIVATIONS", "q8")
    quantized_linear._q8_runs_here.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=quantized_linear.__name__):
            assert quantized_linear.activations() == "f32" and quantized_linear.activations() == "f32"
        assert sum("AVX-512 VNNI" in r.getMessage() for r in caplog.records) == 1
    finally:
        quantized_linear._q8_runs_here.cache_clear()
