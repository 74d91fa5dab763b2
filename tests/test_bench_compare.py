"""``bench compare`` pieces: the random pair of a given shape (--random-shape), and unseeded sampled runs."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from engine.benchmarks.compare import engine_run
from engine.benchmarks.compare import main as compare_main
from engine.benchmarks.random_pair import make_random_pair, parse_shape


def test_random_shape_is_checked() -> None:
    assert parse_shape("1024,12,32000") == (1024, 12, 32000)
    for bad in ("1024,12", "1024,x,3", "1000,2,10", "0,1,1"):
        with pytest.raises(ValueError, match="--random-shape"):
            parse_shape(bad)


def test_random_pair_draft_is_the_targets_first_layer(tmp_path) -> None:
    target, draft = make_random_pair(str(tmp_path), 64, 3, 128)
    t = load_file(os.path.join(target, "model.safetensors"))
    d = load_file(os.path.join(draft, "model.safetensors"))
    assert {k.split(".")[2] for k in d if k.startswith("model.layers.")} == {"0"}
    assert all((d[k] == t[k]).all() for k in d)  # shared, not re-drawn
    with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["num_hidden_layers"] == 1
    # bench compare runs on it end to end (adaptive, and adaptive with a tree on its menu, included) and writes its
    # rows.
    out = tmp_path / "c.json"
    assert compare_main(["--random-shape", "64,3,128", "--random-dir", str(tmp_path / "pairs"), "--batches", "1",
                         "--temperatures", "0", "--max-tokens", "4", "--num-prompts", "1", "--repeats", "1",
                         "--skip-hf", "--skip-floor", "--modes",
                         "specserve_nospec,specserve_adaptive,specserve_adaptive_tree", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["mode"] for r in rows} == {"specserve_nospec", "specserve_adaptive", "specserve_adaptive_tree"}
    assert all(r["tok_s"] > 0 for r in rows)


def _greedy_agreement(target: str, draft: str) -> float:
    """How often the draft's greedy pick equals the target's along the target's own greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM

    t, d = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (target, draft))
    prompts = torch.randint(3, t.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seq = t.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
        picks_t, picks_d = (m(seq).logits[:, 7:-1].argmax(-1) for m in (t, d))
    return (picks_t == picks_d).float().mean().item()


def test_random_pair_draft_accepts(tmp_path) -> None:
    # Adaptive speculation on a larger shape needs a pair whose draft agrees with the target often; an unscaled
    # random target (deep_scale = head_scale = 1) disagrees with its own first layer nearly always.
    accepting = _greedy_agreement(*make_random_pair(str(tmp_path / "a"), 256, 6, 2048))
    plain = _greedy_agreement(*make_random_pair(str(tmp_path / "p"), 256, 6, 2048, deep_scale=1.0, head_scale=1.0))
    assert accepting > 0.6 and plain < 0.3, (accepting, plain)


@pytest.mark.parametrize("seeded", [True, False])
def test_unseeded_runs_send_no_seed(seeded: bool) -> None:
    sent = []

    class FakeLLM:
        engine = SimpleNamespace(stats=SimpleNamespace(), times=SimpleNamespace(), pipeline=None)

        def generate(self, prompts, params):
            sent.extend(params)
            return [SimpleNamespace(token_ids=[1]) for _ in prompts]

    FakeLLM.engine.stats.__init__ = lambda: None
    engine_run(FakeLLM(), [[[1, 2]], [[3]]], 4, 0.8, None, seeded=seeded)
    assert [p.seed for p in sent] == ([0, 1000] if seeded else [None, None])


def test_the_adaptive_ratios_are_also_paired_within_each_repeat() -> None:
    """The machine's speed moves between repeats: adaptive 100 then 50 tokens per CPU-second, a fixed chain 50
    then 100 in the other order. The ratio of medians is 1.0 whatever happened within each repeat; the paired one
    shows each repeat's 2.0 and 0.5."""
    from engine.benchmarks.compare_report import Row, paired

    a = Row("specserve_adaptive", 0.8, 1, tokens=100, cpu_seconds=[1.0, 2.0, 1.0])
    k = Row("specserve_k6", 0.8, 1, tokens=100, cpu_seconds=[2.0, 1.0, 1.0])
    assert paired(a, k) == " [per repeat 2.00, 0.50, 1.00: median 1.00]"
    assert paired(Row("x", 0.0, 1, tokens=1, cpu_seconds=[1.0]), Row("y", 0.0, 1, tokens=1, cpu_seconds=[1.0])) == ""


def test_prompts_for_a_model_without_a_tokenizer(tmp_path) -> None:
    """The random pair has no tokenizer: a prompt file's text lines are skipped (they crashed the run), its token-id
    lines are kept where they fit the vocabulary, and with none left the prompts are random ids."""
    from engine.benchmarks.compare import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f():"}\n{"prompt_token_ids": [5, 6, 7]}\n{"prompt_token_ids": [5, 900]}\n')
    assert load_prompts(str(path), None, 100, 3, 16) == [[5, 6, 7]] * 3
    path.write_text('{"prompt": "def f():"}\n')
    random_ids = load_prompts(str(path), None, 100, 2, 16)
    assert len(random_ids) == 2 and all(0 < t < 100 for ids in random_ids for t in ids)
