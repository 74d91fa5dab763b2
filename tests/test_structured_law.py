"""The sampled-law tests (tests/test_verification_stats.py's harness) with a grammar mask: at every node the
target's law is masked given the node's context, and the draft proposes from its own law masked the same way.

The "grammar" here is a random allowed set per context (the last two tokens), which is all a grammar's state is
to the verifier: a mask that depends on the node's path. Lossless when the draft's recorded q is the masked law it
drew from (chains and trees, i.i.d., without replacement, deterministic); the control draws from the masked law
but records the unmasked one, and must fail. (The engine's draft proposes from its unmasked law today, which is
the plain lossless case these tests cover already; engine/structured/masks.py.)"""

from __future__ import annotations

import pytest
import torch

import tests.test_verification_stats as stats
from tests.test_verification_stats import CHAINS, IID_TREE, MIXED_TREE, WOR_TREE, Config, Params, V

UNMASKED = Params(1.0)  # the control's told law: the draft's own, without the mask


def _masked(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Mask both tables (-inf outside a random allowed set per context, at least one token allowed)."""
    tables, transform = stats._tables, stats._transform
    draft_plain: dict[str, torch.Tensor] = {}

    def masked_tables(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, d = tables(s)
        gen = torch.Generator().manual_seed(500 + seed)
        allowed = torch.rand(V + 1, V + 1, V, generator=gen) < 0.6  # [ctx, ctx, V]
        allowed[..., 0] |= ~allowed.any(dim=-1)
        draft_plain["d"] = d
        inf = torch.tensor(float("-inf"))
        return torch.where(allowed, t, inf), torch.where(allowed, d, inf)

    def told_transform(logits: torch.Tensor, prm: Params, vocab: int = V) -> torch.Tensor:
        return transform(draft_plain["d"] if prm is UNMASKED else logits, prm, vocab)

    monkeypatch.setattr(stats, "_tables", masked_tables)
    monkeypatch.setattr(stats, "_transform", told_transform)


LOSSLESS = {
    "chains_T1": Config(CHAINS, seed=31),
    "iid_tree_T0.9_topk3": Config([IID_TREE], Params(0.9, top_k=3), seed=32),
    "wor_tree_T1.2": Config([WOR_TREE], Params(1.2), seed=33),
    "mixed_topp0.9": Config([MIXED_TREE, *CHAINS], Params(1.0, top_p=0.9), seed=34),
}


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_masked_target_law_under_chains_and_trees(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = LOSSLESS[name]
    _masked(monkeypatch, cfg.seed)
    counts, exact = stats.simulate(cfg)
    assert bool((exact > 0).sum() < exact.numel()), "the mask must cut some sequences"
    p = stats.chi_square_p(counts, exact)
    assert p > 1e-3, f"{name}: chi-square p = {p:.2e}: not the masked target's law"


@pytest.mark.parametrize("shapes", [CHAINS, [IID_TREE]], ids=["chains", "iid_tree"])
def test_masked_draw_recorded_unmasked_is_caught(shapes, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(shapes, seed=35, told_draft=UNMASKED)
    _masked(monkeypatch, cfg.seed)
    counts, exact = stats.simulate(cfg)
    p = stats.chi_square_p(counts, exact)
    assert p < 1e-6, f"chi-square p = {p:.2e}: the wrong recorded q passed"
