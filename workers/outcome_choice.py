"""Which outcomes of the round in flight to pre-draft for (pipelining), by expected value against cost.

A round's outcome is (accepted length j, next token). The controller knows P(rejected at depth j) and P(all
accepted) from the measured per-position acceptance; only the draft worker knows the draft's q along the round's
likely path. The next token's law is estimated from q:

- rejected at depth j: the target draws from the residual max(p - q, 0), normalised. Its support lies off the
  token(s) the draft tried there, so we take the draft's q at that depth without them, renormalised;
- all accepted: the bonus token comes from p, estimated by the draft's q at the leaf.

Each candidate (j, t) is worth P(j) x q~_j(t), the chance that its pre-drafted tree is the one used. The first
(best) outcome is always pre-drafted (the pipeline's point); each further one only while its value pays for its
cost, ``min_value`` (the marginal cost of one more pre-drafted tree over the time a hit saves), up to ``budget``.

Only what gets *prepared* depends on this: a pre-drafted tree is used only when its prefix is the real one, so
output (greedy, seeded, and in law) cannot change.

For greedy requests q is read at temperature 1 (a one-hot would say nothing about second choices); sampled ones
at the request's temperature. Top-k/top-p/min-p are not applied: this is an estimate, not a law anyone samples.
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 1e-5


def choose_outcomes(logits: list[torch.Tensor], weights: list[float], excludes: list[list[int]],
                    temperature: float, budget: int, min_value: float) -> list[tuple[int, int, float]]:
    """(point index, token, value) of the outcomes to pre-draft, best first.

    ``logits[i]``: [V] the draft's raw logits at outcome point i; ``weights[i]``: P(the round ends there);
    ``excludes[i]``: tokens the next token cannot be (the draft's tried children: the residual has no mass there).
    """
    if budget <= 0:
        return []
    t = temperature if temperature >= GREEDY_TEMPERATURE else 1.0
    cands: list[tuple[float, int, int]] = []
    for i, (row, w, excl) in enumerate(zip(logits, weights, excludes, strict=True)):
        if w <= 0.0:
            continue
        q = torch.softmax(row.float() / t, dim=-1)  # [V]
        if excl:
            q[torch.tensor(excl, dtype=torch.long, device=q.device)] = 0.0
        total = float(q.sum())
        if total <= 0.0:
            continue
        vals, toks = q.topk(min(budget, q.shape[0]))
        cands += [(w * v / total, i, tok) for v, tok in zip(vals.tolist(), toks.tolist(), strict=True) if v > 0.0]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))  # ties: the earlier point, then the lower token id
    chosen = cands[:1] + [c for c in cands[1:budget] if c[0] >= min_value]
    return [(i, tok, v) for v, i, tok in chosen]
