"""Draft side: draw a node's children and record the law each child was actually drawn from.

Verification is lossless only if q_i is exactly the law x_i came from (docs/architecture.md), so the draw and
its law are produced together, here, and nowhere else:

- IID: k independent draws from q; every child's law is q (SpecInfer's multi-step speculative sampling).
- WITHOUT_REPLACEMENT: x_i from q with x_1..x_{i-1} removed and renormalised; that is child i's law
  (recursive rejection sampling). Never proposes a token twice, so a k-wide node covers more mass.
- DETERMINISTIC: the k most probable tokens of q (ties: lowest id first), laws one-hot. A greedy/deterministic
  draft is verified as a one-hot q: lossless, but it accepts less at temperature > 0, because a one-hot q
  accepts x only with prob r(x) instead of min(1, r(x)/q(x)).

Without replacement and deterministic propose at most |support(q)| distinct tokens: asked for more, they
return fewer children (the batched form pads with token -1 and a zero law row, which verification treats as
an absent node). Every returned token has law(token) > 0.

Randomness: IID and WITHOUT_REPLACEMENT use one uniform per child (k per node, whether or not the support
ran out); DETERMINISTIC uses none.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from workers.sampling import draw_uniforms, sample_with_uniforms


class ProposalMode(str, enum.Enum):
    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"
    DETERMINISTIC = "deterministic"


def draw_children_batch(
    q: torch.Tensor, k: int, mode: ProposalMode | str, uniforms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Children for B nodes at once. q [B, V] (already transformed), uniforms [B, k] in [0, 1).

    Returns tokens [B, k] long (-1 where a row's support ran out) and laws [B, k, V] float32 (zero rows there).
    `uniforms` is required except for DETERMINISTIC.
    """
    mode = ProposalMode(mode)
    if q.dim() != 2:
        raise ValueError(f"q must be [B, V], got shape {tuple(q.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    q = q.float()
    bsz, vocab = q.shape
    if mode is ProposalMode.DETERMINISTIC:
        width = min(k, vocab)
        top_p, top_i = q.sort(dim=-1, descending=True, stable=True)  # stable: ties go to the lowest id
        ok = top_p[:, :width] > 0  # [B, width]
        tokens = torch.where(ok, top_i[:, :width], torch.full_like(top_i[:, :width], -1))
        laws = torch.zeros(bsz, width, vocab, device=q.device)
        laws.scatter_(2, top_i[:, :width].unsqueeze(-1), ok.unsqueeze(-1).float())
        pad = k - width  # k > vocab: nothing more to propose
        if pad:
            tokens = torch.cat([tokens, tokens.new_full((bsz, pad), -1)], dim=1)
            laws = torch.cat([laws, laws.new_zeros(bsz, pad, vocab)], dim=1)
        return tokens, laws

    if uniforms is None or uniforms.shape != (bsz, k):
        got = None if uniforms is None else tuple(uniforms.shape)
        raise ValueError(f"mode {mode.value} needs uniforms of shape [{bsz}, {k}], got {got}")
    uniforms = uniforms.to(q.device)
    if mode is ProposalMode.IID:
        laws = q.unsqueeze(1).expand(bsz, k, vocab).clone()  # [B, k, V]
        return sample_with_uniforms(laws, uniforms), laws

    # Without replacement: draw, remove, renormalise, k times; row-local so rows never interact.
    law = q.clone()  # [B, V]
    toks, laws = [], []
    for i in range(k):
        mass = law.sum(dim=-1, keepdim=True)  # [B, 1]
        alive = mass.squeeze(-1) > 0  # [B] support not yet exhausted
        law_i = torch.where(alive.unsqueeze(-1), law / mass.clamp(min=torch.finfo(law.dtype).tiny), 0.0)
        tok = sample_with_uniforms(law_i, uniforms[:, i])  # [B]
        toks.append(torch.where(alive, tok, torch.full_like(tok, -1)))
        laws.append(law_i)
        law = law.scatter(1, tok.unsqueeze(-1), 0.0)
    if not toks:
        return torch.empty(bsz, 0, dtype=torch.long, device=q.device), q.new_zeros(bsz, 0, vocab)
    return torch.stack(toks, dim=1), torch.stack(laws, dim=1)


def draw_children(
    q: torch.Tensor, k: int, mode: ProposalMode | str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Children of one node: q [V] -> tokens [k'] long, laws [k', V] with k' <= k (see module doc).

    A greedy/deterministic draft is verified as a one-hot q: lossless, but it accepts less at temperature > 0.
    """
    mode = ProposalMode(mode)
    if q.dim() != 1:
        raise ValueError(f"q must be [V], got shape {tuple(q.shape)}")
    u = None
    if mode is not ProposalMode.DETERMINISTIC:
        u = draw_uniforms([generator], [k], q.device)[0].unsqueeze(0)  # [1, k]
    tokens, laws = draw_children_batch(q.unsqueeze(0), k, mode, u)
    keep = tokens[0] >= 0  # padding only ever sits at the end
    return tokens[0][keep], laws[0][keep]


def draw_children_many(
    q: torch.Tensor, k: int, mode: ProposalMode | str, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """draw_children_batch with row i's uniforms drawn from generators[i] (in row order)."""
    mode = ProposalMode(mode)
    if len(generators) != q.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {q.shape[0]} rows of q")
    u = None
    if mode is not ProposalMode.DETERMINISTIC:
        u = torch.stack(draw_uniforms(generators, [k] * len(generators), q.device)).reshape(-1, k)  # [B, k]
    return draw_children_batch(q, k, mode, u)
