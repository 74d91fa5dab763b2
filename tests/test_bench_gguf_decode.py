"""``python -m benchmarks.gguf_decode``: the weight bytes it reports, and a run end to end on the real file."""

from __future__ import annotations

import json

import pytest

from benchmarks.gguf_decode import gguf_weight_bytes, weight_bytes
from engine import LLM
from tests.conftest import VOCAB, workers
from tests.helpers_gguf import hf_to_gguf, smollm2_path
from tests.helpers_models import make_tiny_checkpoint
from workers.kernels.gguf_blocks import available as native_kernel
from workers.quantized_linear import activations


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_weight_bytes_from_the_file_are_what_the_engine_holds(tmp_path, quantization: str) -> None:
    """Read from the file's tensor table, without reaching into the engine: the 4-bit matrices packed under
    ``--quantization gguf`` and everything else in float32."""
    hf = make_tiny_checkpoint(tmp_path / "hf", family="llama", vocab_size=VOCAB, seed=0)
    path = hf_to_gguf(hf, tmp_path / "tiny.gguf", "Q4_1")
    llm = LLM(path, None, quantization=quantization, num_kv_tokens=64, max_num_seqs=1)
    try:
        held = weight_bytes(workers(llm.engine)[0].model)
    finally:
        llm.shutdown()
    # with the native block kernel every block matrix (embedding, head included) is held as the file stores it
    # (repacked, and the tied table twice, with 8-bit activations)
    native = quantization == "gguf" and native_kernel()
    assert gguf_weight_bytes(path, quantization == "gguf", native, native and activations() == "q8") == held
    assert gguf_weight_bytes(path, packed=True) < gguf_weight_bytes(path, packed=False)


@pytest.mark.slow
def test_gguf_decode_runs_on_smollm2(tmp_path) -> None:
    from benchmarks.gguf_decode import main

    path = smollm2_path()
    out = tmp_path / "g.json"
    assert main(["--target", path, "--max-tokens", "2", "--repeats", "1", "--modes", "specserve_q4",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["mode"] == "specserve_q4" and row["tok_s"] > 0
    assert row["weight_bytes"] == gguf_weight_bytes(path, packed=True, native=native_kernel())


@pytest.mark.slow
def test_gguf_decode_runs_the_shipped_speculation_beside_plain(tmp_path) -> None:
    from benchmarks.gguf_decode import main

    smollm2_path()  # skips without the package
    out = tmp_path / "g.json"
    assert main(["--target", "smollm2", "--max-tokens", "8", "--repeats", "1", "--modes",
                 "specserve_q4,specserve_shipped", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"specserve_q4", "specserve_shipped"} and rows["specserve_shipped"]["tok_s"] > 0
    with pytest.raises(SystemExit, match="packaged target"):
        main(["--target", smollm2_path(), "--max-tokens", "2", "--repeats", "1", "--modes", "specserve_shipped"])
