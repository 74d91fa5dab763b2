"""Exact next-token logits of a tiny target by enumeration: the reference the sampled-law tests compare with."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def continuation_logits(target: str, prompt: list[int], vocab: int) -> np.ndarray:
    """[V, V, V, 4, V]: the target's logits after ``prompt`` + (t1, t2, t3), at the 4 positions that predict
    t1..t4, for every continuation (transformers' float32 forward, in float64)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    conts = torch.tensor(list(itertools.product(range(vocab), repeat=3)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1:].double().numpy()  # [V^3, 4, V]
    return logits.reshape(vocab, vocab, vocab, 4, vocab)


def record_flatter_q(monkeypatch) -> None:
    """Negative controls: drafts still drawn from q, but q^(1/2) recorded (the draft's law at twice its
    temperature, the silent error docs/architecture.md warns about); the sampled-law tests must then fail."""
    import workers.draft_worker as draft_worker

    real = draft_worker.draw_children

    def flatter_q(q, k, mode, generator):
        tokens, laws = real(q, k, mode, generator)
        wrong = laws.sqrt()
        return tokens, wrong / wrong.sum(dim=-1, keepdim=True)

    monkeypatch.setattr(draft_worker, "draw_children", flatter_q)
