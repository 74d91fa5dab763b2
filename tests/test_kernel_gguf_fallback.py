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
