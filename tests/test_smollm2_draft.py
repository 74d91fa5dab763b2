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

    # Prefill distillation: the target's top-k labels on its answers and on local text, then KL from the shards.
    for source, dtype in (("gen", "fp32"), ("text", "bf16")):
        smollm2_draft.main(["label", "--quick", "--source", source, "--target", target, "--work", str(work),
                            "--minutes", "1", "--label-dtype", dtype])
    for source in ("gen", "text"):
        ls = json.loads((work / f"label_{source}_stats.json").read_text())
        assert ls["sequences"] > 0 and ls["labelled_positions"] > 0, ls
    labelled = smollm2_draft._read_labels(work, ["gen"])["gen"]
    assert 0 < len(labelled) <= len(rows) and all(len(s["top_ids"]) == int(s["mask"].sum()) for s in labelled)
    # The labels sit at the right positions: in a greedy answer, the target's top-1 at each labelled position is
    # the token the engine chose next (fp32 target here, so the engine's greedy == transformers' argmax).
    greedy = {tuple(r["prompt_ids"] + r["answer_ids"]): r for r in rows if r["temperature"] == 0.0}
    checked = 0
    for s in labelled:
        r = next((g for k, g in greedy.items() if k[:len(s["ids"])] == tuple(s["ids"].tolist())), None)
        if r is not None:
            assert s["ids"][1:][s["mask"][:-1]].tolist() == s["top_ids"][:, 0].tolist()
            checked += 1
    assert checked >= 5
    smollm2_draft.main(["distill", "--quick", "--labels", "topk", "--sources", "text,gen,genhard", "--repeat",
                        "gen=2", "--bf16", "--target", target, "--work", str(work), "--out", str(out),
                        "--minutes", "1"])
    stats = json.loads((work / "distill_stats.json").read_text())
    assert stats["labels"] == "topk" and stats["steps"] == 3 and stats["loss_last10"] >= 0
    assert set(stats["heldout_agreement_after"]) == {"gen", "text", "genhard"}

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
