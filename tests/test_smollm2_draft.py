"""The SmolLM2 draft stage's --quick path (training/smollm2_draft.py) on a tiny random target, in seconds:
gen -> init -> distill writes a trimmed-vocabulary draft that the engine serves, greedy output unchanged."""

from __future__ import annotations

import json
import os

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import spec
from tests.helpers_models import make_tiny_checkpoint
from training import smollm2_draft
from workers.vocab_map import DraftVocabMap


def test_quick_stage_builds_a_servable_trimmed_draft(tmp_path) -> None:
    target = make_tiny_checkpoint(tmp_path / "target", family="llama", vocab_size=128, seed=2, with_tokenizer=True)
    work, out = tmp_path / "work", tmp_path / "draft"
    smollm2_draft.main(["all", "--quick", "--target", target, "--work", str(work), "--out", str(out),
                        "--minutes", "1"])
    rows = [json.loads(line) for line in open(work / "gen.jsonl")]
    assert rows and all(r["answer_ids"] for r in rows)
    heldout = [json.loads(line)["prompt"] for line in open(work / "heldout_prompts.jsonl")]
    assert heldout and not set(heldout) & {smollm2_draft.compose_prompts()[r["index"]] for r in rows}
    vmap = DraftVocabMap.load(str(out))
    assert vmap is not None and vmap.size == 64 and set(range(3)) <= set(vmap.ids.tolist())  # special ids kept
    stats = json.loads((work / "distill_stats.json").read_text())
    assert stats["steps"] == 3 and stats["loss_last10"] >= 0 and stats["labels"] == "soft"
    smollm2_draft.main(["distill", "--quick", "--labels", "hard", "--target", target, "--work", str(work),
                        "--out", str(out), "--minutes", "1"])
    stats = json.loads((work / "distill_stats.json").read_text())
    assert stats["labels"] == "hard" and stats["steps"] >= 1 and stats["loss_last10"] > 0
    assert os.path.getsize(out / "model.safetensors") < 100_000

    smollm2_draft.main(["measure", "--quick", "--target", target, "--work", str(work), "--out", str(out),
                        "--speed-prompts", "2"])
    m = json.loads((work / "measure.json").read_text())
    assert m["greedy_identical"] and m["mean_acceptance_length"] >= 1 and m["prompts"] == len(heldout)

    prompts = [[1, 40, 41, 42], [1, 70, 3, 99, 100]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target, None, max_model_len=64).generate(prompts, params)]
    llm = LLM(target, spec(str(out), k=3), max_model_len=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats.num_drafted > 0
