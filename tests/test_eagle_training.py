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


def test_cached_run_writes_a_head_and_extends_its_cache(llama, tmp_path) -> None:
    """--cache: the target's features and laws are computed once (a second run adds only new answers)."""
    from training.eagle_cache import read_cache

    work, cache = tmp_path / "work", tmp_path / "cache"
    _gen_jsonl(work, 4)
    args = ["--quick", "--target", llama.target, "--work", str(work), "--out", str(tmp_path / "head"),
            "--draft-vocab", "64", "--cache", str(cache)]
    main(args)
    assert len(read_cache(cache, ["gen"])["gen"]) == 4
    _gen_jsonl(work, 7)
    main(args)
    seqs = read_cache(cache, ["gen"])["gen"]
    assert sorted(s.index for s in seqs) == list(range(7)) and seqs[0].aux.shape[-1] == 3 * 64
    head = load_head(str(tmp_path / "head"), llama.target, ModelConfig.from_pretrained(llama.target))
    assert head.head_config.draft_vocab_size == 64


def test_training_time_test_attends_as_drafting_does() -> None:
    """Step s, row j (depth s + 1 drafted from row j - s) sees step 0's keys up to row j - s, then one key of each
    later step on its own path: rows j - s + 1 .. j. Step 0 is plain causal attention."""
    import math

    import torch

    from training.eagle_distill import TTTContext
    from workers.attention import DenseCausalContext

    torch.manual_seed(0)
    lens, hq, hkv, d = [5, 7], 6, 2, 4
    q, k, v = ([torch.randn(12, h, d) for _ in range(3)] for h in (hq, hkv, hkv))
    ctx = TTTContext(lens)
    out = [ctx.attend(0, q[s], k[s], v[s]) for s in range(3)]
    assert torch.allclose(out[0], DenseCausalContext(lens).attend(0, q[0], k[0], v[0]), atol=1e-6)
    for s in (1, 2):
        for off, n in ((0, 5), (5, 7)):
            for j in range(s, n):
                rows = [(0, i) for i in range(j - s + 1)] + [(t, j - s + t) for t in range(1, s + 1)]
                keys = torch.stack([k[t][off + i] for t, i in rows]).repeat_interleave(hq // hkv, 1)  # [L, Hq, D]
                vals = torch.stack([v[t][off + i] for t, i in rows]).repeat_interleave(hq // hkv, 1)
                p = (torch.einsum("hd,lhd->hl", q[s][off + j], keys) / math.sqrt(d)).softmax(-1)
                assert torch.allclose(out[s][off + j], torch.einsum("hl,lhd->hd", p, vals), atol=1e-5), (s, j)


def test_equal_length_batches_attend_as_the_per_sequence_loop() -> None:
    """Sequences of one length (padded batches: training/eagle_online.py) take a batched path; it computes what the
    per-sequence loop computes, at every training-time-test step."""
    import torch

    from training.eagle_distill import TTTContext

    torch.manual_seed(1)
    b, n, hq, hkv, d = 3, 6, 6, 2, 4
    q, k, v = ([torch.randn(b * n, h, d) for _ in range(3)] for h in (hq, hkv, hkv))
    one = [torch.zeros(1, h, d) for h in (hq, hkv, hkv)]  # a 1-row extra sequence: unequal lengths, the loop path
    uniform, loop = TTTContext([n] * b), TTTContext([n] * b + [1])
    for s in range(3):
        got = uniform.attend(0, q[s], k[s], v[s])
        want = loop.attend(0, *(torch.cat([x[s], z]) for x, z in zip((q, k, v), one, strict=True)))[: b * n]
        assert torch.allclose(got, want, atol=1e-5), s


def test_a_cached_run_continues_from_a_head(llama, tmp_path) -> None:
    """--init: the run starts from the given head (its weights, its draft vocabulary whatever --draft-vocab says)
    instead of a fresh one."""
    from safetensors.torch import load_file

    work, cache = tmp_path / "work", tmp_path / "cache"
    _gen_jsonl(work, 4)
    common = ["--quick", "--target", llama.target, "--work", str(work), "--cache", str(cache)]
    main([*common, "--out", str(tmp_path / "first"), "--draft-vocab", "64"])
    main([*common, "--out", str(tmp_path / "fresh"), "--draft-vocab", "32"])
    main([*common, "--out", str(tmp_path / "next"), "--draft-vocab", "32", "--init", str(tmp_path / "first")])
    config = ModelConfig.from_pretrained(llama.target)
    first, nxt = (load_head(str(tmp_path / d), llama.target, config) for d in ("first", "next"))
    assert nxt.head_config.draft_vocab_size == 64 and nxt.draft_ids.tolist() == first.draft_ids.tolist()
    w = {d: load_file(str(tmp_path / d / "model.safetensors"))["fc.weight"].float() for d in ("first", "fresh", "next")}
    # a quick run moves the weights a little: the continued head stays nearer its start than a fresh one is
    assert (w["next"] - w["first"]).norm() < 0.5 * (w["fresh"] - w["first"]).norm()
