"""``python -m training.exit_adapter --quick`` trains and saves an adapter the engine loads and drafts with."""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from training.exit_adapter import main

TARGET = "engine/default_models/target"


@pytest.mark.slow  # builds the corpus and runs the target: ~12 s
def test_quick_run_writes_an_adapter_the_engine_uses(tmp_path) -> None:
    out = tmp_path / "exit"
    main(["--out", str(out), "--layers", "3", "--quick"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["exit_layer"] == 3 and cfg["target"] == "target" and (out / "MODEL_CARD.md").is_file()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLM(TARGET).generate([[1, 17, 44]], params)[0].token_ids
    with LLM(TARGET, {"method": "layer_skip", "model": str(out), "num_speculative_tokens": 3}) as llm:
        assert llm.generate([[1, 17, 44]], params)[0].token_ids == expected
        assert llm.engine.stats.num_drafted > 0
