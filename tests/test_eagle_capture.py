"""python -m training.eagle_capture: answers and their features from one pass, in the feature cache's layout."""

from __future__ import annotations

import torch

from tests.helpers_models import make_tiny_checkpoint
from training.eagle_cache import read_cache
from training.eagle_capture import run
from training.eagle_online import GenConfig


def test_captured_features_and_laws_are_a_teacher_forced_pass(tmp_path) -> None:
    """Each cached answer's features and next-token laws are those of one forward over the whole sequence (so
    training from the capture is training from the target), and a second run resumes, adding nothing."""
    from training.smollm2_draft import load_hf_target

    target = make_tiny_checkpoint(tmp_path / "t", with_tokenizer=True, seed=5, num_hidden_layers=2)
    cfg = GenConfig(minutes=1.0, samples=2, self_instruct=0, max_tokens=5, batch=4, instructions=5)
    stats = run(target, tmp_path / "cache", cfg, log=lambda _: None)
    assert stats["planned"] == 10 and stats["cached"] == 10
    seqs = read_cache(tmp_path / "cache", ["gen"])["gen"]
    assert len(seqs) == 10 and all(0 < len(s.ids) - s.answer_start <= 5 for s in seqs)
    model = load_hf_target(target).to(torch.bfloat16)
    agree = total = 0
    for s in seqs:
        out = model(s.ids[None], output_hidden_states=True)
        n, a = len(s.ids), s.answer_start
        feats = torch.cat([out.hidden_states[i] for i in (1, 1, 0)], -1)[0].float()  # a 2-layer target's (2, 1, -1)
        assert torch.allclose(s.aux[: n - 1].float(), feats[: n - 1], atol=0.05, rtol=0.02)
        assert not s.aux[n - 1].any()  # the last token is never fed: no feature
        lp = torch.log_softmax(out.logits[0].float(), -1)[a - 1: n - 1]  # the laws of the answer's tokens
        assert torch.allclose(s.top_logp[a - 1: n - 1, 0].float(), lp.max(-1).values, atol=0.05)
        agree += int((s.top_ids[a - 1: n - 1, 0].long() == lp.argmax(-1)).sum())
        total += n - a
    assert agree >= 0.9 * total, (agree, total)  # bfloat16 ties aside, the same top token
    assert run(target, tmp_path / "cache", cfg, log=lambda _: None)["positions_this_run"] == 0
