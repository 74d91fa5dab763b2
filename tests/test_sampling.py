"""Sampling transforms and draws (workers/sampling.py): hand-made examples, a slow reference, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from workers.sampling import SamplingBatch, draw_uniforms, logits_to_probs, sample, sample_with_uniforms


def _batch(n: int = 1, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0):
    return SamplingBatch.from_lists([temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n)


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def _reference(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Plain-Python statement of the documented order: temperature, min-p, top-k, top-p (no ties assumed)."""
    v = len(row)
    if temperature == 0:
        best = max(range(v), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    x = [a / temperature for a in row]
    m = max(x)
    z = sum(math.exp(a - m) for a in x)
    probs = [math.exp(a - m) / z for a in x]
    alive = [p >= min_p * max(probs) for p in probs]
    order = sorted((i for i in range(v) if alive[i]), key=lambda i: -x[i])
    if 0 < top_k < v:
        order = order[:top_k]
    if top_p < 1:
        mass = sum(probs[i] for i in order)
        kept, acc = [], 0.0
        for i in order:
            if acc >= top_p:
                break
            kept.append(i)
            acc += probs[i] / mass
        order = kept
    total = sum(probs[i] for i in order)
    return [probs[i] / total if i in order else 0.0 for i in range(v)]


def test_greedy_rows_are_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 5.0, 5.0]])
    probs = logits_to_probs(logits, _batch(2, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert _batch(2, temperature=0.0).all_greedy
    assert not SamplingBatch.from_lists([0.0, 0.5], [-1, -1], [1.0, 1.0], [0.0, 0.0]).all_greedy


def test_temperature_only_is_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -3.0]])
    for t in (0.5, 1.0, 2.0):
        got = logits_to_probs(logits, _batch(temperature=t))
        assert torch.allclose(got, torch.softmax(logits / t, dim=-1), atol=1e-7)


def test_min_p_hand_example_uses_probs_after_temperature() -> None:
    logits = _log([0.5, 0.3, 0.15, 0.05])
    got = logits_to_probs(logits, _batch(min_p=0.2))  # floor 0.1: drops 0.05
    assert torch.allclose(got, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)
    # At T=2 the probs flatten to ~(0.379, 0.294, 0.208, 0.120): min_p 0.4 keeps three tokens, where the
    # untempered probs (floor 0.2) would keep two. That pins min-p after temperature.
    got = logits_to_probs(logits, _batch(temperature=2.0, min_p=0.4))
    assert (got[0] > 0).tolist() == [True, True, True, False]


def test_top_k_hand_example_and_off_values() -> None:
    logits = _log([0.5, 0.3, 0.15, 0.05])
    got = logits_to_probs(logits, _batch(top_k=2))
    assert torch.allclose(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    full = torch.softmax(logits, dim=-1)
    for off in (-1, 0, 4, 100):
        assert torch.allclose(logits_to_probs(logits, _batch(top_k=off)), full, atol=1e-7)
    # Ties at the k-th value are all kept: the result must not depend on sort order.
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert (logits_to_probs(tied, _batch(top_k=1))[0] > 0).tolist() == [False, True, True, False]


def test_top_p_hand_example() -> None:
    logits = _log([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05; mass before: 0, .5, .8, .95
    expect = {0.4: [0, 1, 0, 0], 0.75: [0, 1, 0, 1], 0.85: [1, 1, 0, 1], 1.0: [1, 1, 1, 1]}
    for top_p, kept in expect.items():
        got = logits_to_probs(logits, _batch(top_p=top_p))[0]
        assert (got > 0).long().tolist() == kept, top_p
        assert abs(float(got.sum()) - 1.0) < 1e-6


def test_matches_plain_python_reference_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    n, v = 200, 12
    logits = torch.randn(n, v, generator=gen) * 2
    rows = [
        (
            [0.0, 0.3, 0.7, 1.0, 1.8][i % 5],
            [-1, 1, 3, 7, 12][(i // 5) % 5],
            [1.0, 0.9, 0.6, 0.3][(i // 25) % 4],
            [0.0, 0.05, 0.3][i % 3],
        )
        for i in range(n)
    ]
    params = SamplingBatch.from_lists(*[list(c) for c in zip(*rows, strict=True)])
    got = logits_to_probs(logits, params)
    for i, (t, k, p, m) in enumerate(rows):
        ref = torch.tensor(_reference(logits[i].tolist(), t, k, p, m))
        assert torch.allclose(got[i], ref, atol=1e-5), (i, t, k, p, m, got[i], ref)


def test_row_alone_equals_row_inside_large_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    n, v = 96, 1000
    logits = torch.randn(n, v, generator=gen) * 3
    temps = [[0.0, 0.5, 1.0, 1.7][i % 4] for i in range(n)]
    ks = [[-1, 5, 50, 999][(i // 4) % 4] for i in range(n)]
    ps = [[1.0, 0.95, 0.5][i % 3] for i in range(n)]
    ms = [[0.0, 0.01, 0.2][(i // 3) % 3] for i in range(n)]
    batch = logits_to_probs(logits, SamplingBatch.from_lists(temps, ks, ps, ms))
    for i in range(n):
        alone = logits_to_probs(logits[i : i + 1], SamplingBatch.from_lists([temps[i]], [ks[i]], [ps[i]], [ms[i]]))
        assert torch.equal(alone[0], batch[i]), i


def test_repeat_rows_and_validation() -> None:
    params = SamplingBatch.from_lists([0.0, 0.8], [-1, 5], [1.0, 0.9], [0.0, 0.1])
    rep = params.repeat_rows([2, 3])
    assert rep.temperature.tolist() == pytest.approx([0.0, 0.0, 0.8, 0.8, 0.8])
    assert rep.top_k.tolist() == [-1, -1, 5, 5, 5]
    assert len(params.repeat_rows([0, 1])) == 1
    with pytest.raises(ValueError, match="top_p"):
        SamplingBatch.from_lists([1.0], [-1], [0.0], [0.0])
    with pytest.raises(ValueError, match="length"):
        SamplingBatch.from_lists([1.0], [-1, 2], [1.0], [0.0])
    with pytest.raises(ValueError, match="does not match"):
        logits_to_probs(torch.zeros(3, 4), params)


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999999, 1.0 - 2**-24])
    got = sample_with_uniforms(probs.expand(5, 5), u)
    assert got.tolist() == [1, 1, 3, 3, 3]
    one_hot = torch.zeros(3, 7)
    one_hot[0, 6] = one_hot[1, 0] = one_hot[2, 3] = 1.0
    for uu in (0.0, 0.5, 1.0 - 2**-24):
        assert sample_with_uniforms(one_hot, torch.full((3,), uu)).tolist() == [6, 0, 3]


def test_sample_follows_probs() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = torch.Generator().manual_seed(2)
    n = 20000
    toks = sample(probs.expand(n, 4), [gen] * n)
    freq = torch.bincount(toks, minlength=4).double() / n
    # 4 binomial standard errors at n = 20000 is at most 0.014.
    assert freq[1] == 0
    assert torch.allclose(freq, probs.double(), atol=0.015)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch() -> None:
    probs = torch.softmax(torch.randn(10, 50, generator=torch.Generator().manual_seed(3)), dim=-1)
    mine = probs[:3]  # one request, three rows (e.g. three tree nodes)

    def run(others_before: int, others_after: int, other_seeded: bool) -> list[int]:
        gens: list[torch.Generator | None] = []
        rows = []
        for i in range(others_before):
            gens.append(torch.Generator().manual_seed(100 + i) if other_seeded else None)
            rows.append(probs[3 + i])
        mine_gen = torch.Generator().manual_seed(42)
        gens += [mine_gen] * 3
        rows += list(mine)
        for i in range(others_after):
            gens.append(None)
            rows.append(probs[9 - i])
        out = sample(torch.stack(rows), gens)
        return out[others_before : others_before + 3].tolist()

    ref = run(0, 0, False)
    assert run(4, 2, True) == ref
    assert run(6, 1, False) == ref
    assert run(1, 3, True) == ref


def test_draw_uniforms_serves_a_shared_generator_in_order() -> None:
    g = torch.Generator().manual_seed(7)
    a, b, c = draw_uniforms([g, None, g], [2, 3, 1], "cpu")
    fresh = torch.Generator().manual_seed(7)
    assert torch.equal(a, torch.rand(2, generator=fresh))
    assert torch.equal(c, torch.rand(1, generator=fresh))
    assert b.shape == (3,)
