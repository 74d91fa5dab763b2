"""python -m training.eagle_online: the target writes its answers and a head trains beside it (tiny model, CPU)."""

from __future__ import annotations

import gzip
import json

from training.eagle_distill import DistillConfig
from training.eagle_online import GenConfig, OnlineRun, run
from workers.eagle.head import load_head
from workers.model_config import ModelConfig


def test_online_run_writes_answers_and_a_head_the_engine_loads(with_tokenizer, tmp_path) -> None:
    out = tmp_path / "head"
    stats = run(OnlineRun(with_tokenizer, str(out), "cpu", draft_vocab=32,
                          gen=GenConfig(minutes=1.0, samples=2, self_instruct=0, max_tokens=6, batch=8,
                                        instructions=9),
                          train=DistillConfig(minutes=0.05, tokens=256, eval_every_s=1.0, warmup_steps=1)),
                log=lambda _: None)
    with gzip.open(out / "gen-0.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    # 9 instructions answered greedily and once sampled; each answer stops at EOS or at max_tokens
    assert len(rows) == 18 and {r["temperature"] for r in rows} == {0.0, 0.8}
    assert all(0 < len(r["answer_ids"]) <= 6 for r in rows) and stats["answers"] == 18
    assert stats["steps"] >= 1 and len(stats["heldout_top1_per_step"]) == 3
    head = load_head(str(out), with_tokenizer, ModelConfig.from_pretrained(with_tokenizer))
    assert head.head_config.draft_vocab_size == 32
