"""python -m training.eagle: the smoke path writes a head the engine loads, and the objective trains."""

from __future__ import annotations

import json
import os
import re

import pytest

from training.eagle import EagleTrainConfig, main, train_head
from workers.eagle.head import load_head
from workers.model_config import ModelConfig


def _gen_jsonl(work, n: int = 6) -> None:
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "gen.jsonl"), "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_ids": [1, 3 + i], "answer_ids": [(7 * i + 5 * j) % 120 + 3 for j in range(60)]})
                    + "\n")


def test_quick_run_writes_a_head_the_engine_loads(llama, tmp_path) -> None:
    _gen_jsonl(tmp_path / "work")
    out = tmp_path / "head"
    main(["--quick", "--target", llama.target, "--work", str(tmp_path / "work"), "--out", str(out),
          "--draft-vocab", "64"])
    with open(out / "train_stats.json") as f:
        assert json.load(f)["steps"] == 3
    head = load_head(str(out), llama.target, ModelConfig.from_pretrained(llama.target))
    assert head.head_config.draft_vocab_size == 64 and head.draft_ids is not None


def test_the_objective_trains(llama, tmp_path) -> None:
    """Training-time test over 3 steps on a repetitive corpus: the loss falls well below where it started."""
    seqs = [[1] + [(5 * i + 3 * (j % 7)) % 120 + 3 for j in range(80)] for i in range(12)]
    losses: list[float] = []

    def log(line: str) -> None:
        losses.append(float(re.search(r"loss ([0-9.]+)", line).group(1)))

    stats = train_head(llama.target, seqs, str(tmp_path / "head"),
                       EagleTrainConfig(minutes=1.0, steps=60, batch=4, seq_len=32, lr=5e-3), log=log)
    assert stats["final_loss"] < 0.5 * losses[0], (losses, stats)


@pytest.mark.slow
def test_builtin_quick_cli(tmp_path) -> None:
    """The documented smoke command (reads the stdlib corpus and runs the built-in target: tens of seconds)."""
    main(["--quick", "--out", str(tmp_path / "head")])
    assert (tmp_path / "head" / "model.safetensors").is_file()
