"""``python -m benchmarks.gguf_decode --profile``: its op classes name the kernels each path really runs (a
renamed or rerouted kernel would leave its time under "elementwise" and the profile would mislead)."""

from __future__ import annotations

import pytest

from benchmarks.gguf_decode import profile_forwards
from tests.helpers_gguf import hf_to_gguf
from tests.helpers_models import make_tiny_checkpoint
from workers.kernels.gguf_blocks import available as native_kernel
from workers.kernels.row_attention import native_here


@pytest.mark.parametrize("quantization, matmuls", [("gguf", "int4 matmuls"), ("none", "float matmuls")])
def test_profile_attributes_the_forward_to_its_kernels(tmp_path, quantization: str, matmuls: str) -> None:
    hf = make_tiny_checkpoint(tmp_path / "hf", family="llama", vocab_size=128, seed=3, head_dim=16,
                              num_attention_heads=4, num_key_value_heads=2)
    path = hf_to_gguf(hf, tmp_path / "tiny-q4_1.gguf", "Q4_1")
    native = quantization == "gguf" and native_kernel()  # every matrix, the head too, in the native kernel
    matmuls = "block matmuls (native)" if native else matmuls
    attention = "attention (native, all rows)" if native_here() else "attention (SDPA)"  # float32 rows, both models
    one, five = profile_forwards(path, quantization, [1, 5], steps=2)
    assert (one["rows"], five["rows"]) == (1, 5)
    for r in (one, five):
        c = r["classes_ms"]
        # (a head this small goes through the fixed-shape chunks, "float matmuls": KernelConfig.head_gemv_bytes)
        assert c[matmuls] > 0 and (native or c["float matmuls"] > 0) and c[attention] > 0, c
        assert sum(c.values()) >= r["wall_ms"] * 0.999  # "outside torch ops" closes the sum
