"""The grouped, skip-what-is-neutral transforms (workers/sampling.logits_to_probs) give exactly the bits of the
plain one-pass form they replaced: every step on every row, a full stable torch sort (kept below as the
reference). Bit equality matters: seeded outputs must not change, and p is what verification compares q with.
"""

from __future__ import annotations

import random

import torch

from workers.sampling import SamplingBatch, _sorted_descending, logits_to_probs


def _reference(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """The previous logits_to_probs, verbatim: temperature, min-p, top-k, top-p over every row."""
    n, vocab = logits.shape
    logits = logits.float()
    greedy = params.is_greedy
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    x = logits / temp.unsqueeze(1)
    neg_inf = torch.tensor(float("-inf"))
    probs = torch.softmax(x, dim=-1)
    floor = params.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    x = torch.where(probs >= floor, x, neg_inf)
    sorted_x = x.sort(dim=-1, descending=True, stable=True).values
    k = params.top_k
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
    x = torch.where(x >= kth, x, neg_inf)
    sorted_x = torch.where(sorted_x >= kth, sorted_x, neg_inf)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = before < params.top_p.unsqueeze(1)
    num_keep = keep_sorted.sum(dim=-1, keepdim=True).clamp(min=1)
    cutoff = sorted_x.gather(1, num_keep - 1)
    top_p_on = (params.top_p < 1).unsqueeze(1)
    x = torch.where(top_p_on & (x < cutoff), neg_inf, x)
    out = torch.softmax(x, dim=-1)
    one_hot = torch.zeros_like(out)
    one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, out)


def _random_params(rng: random.Random, n: int, vocab: int) -> SamplingBatch:
    temps = [rng.choice([0.0, 1e-6, 0.3, 0.8, 1.0, 1.7]) for _ in range(n)]
    ks = [rng.choice([-1, 0, 1, 2, 5, vocab // 3, vocab - 1, vocab, vocab + 3]) for _ in range(n)]
    ps = [rng.choice([1.0, 1.0, 0.999, 0.9, 0.5, 0.2, 1e-3]) for _ in range(n)]
    mps = [rng.choice([0.0, 0.0, 0.01, 0.1, 0.5, 1.0]) for _ in range(n)]
    return SamplingBatch.from_lists(temps, ks, ps, mps)


def _random_logits(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    # Coarse values make many exact ties (at the k-th value, at the top-p cutoff, at the argmax).
    logits = torch.randint(-6, 7, (n, vocab), generator=gen).float() * 0.5
    fine = torch.randn(n, vocab, generator=gen) * 3
    use_fine = torch.rand(n, 1, generator=gen) < 0.5
    logits = torch.where(use_fine, fine, logits)
    logits[0, : vocab // 4] = float("-inf")  # masked tokens (a padded vocabulary)
    return logits


def test_matches_reference_bit_for_bit_over_random_params():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for trial in range(60):
        vocab = rng.choice([7, 64, 257, 4096])
        n = rng.choice([1, 3, 9, 20])
        logits, params = _random_logits(gen, n, vocab), _random_params(rng, n, vocab)
        got, want = logits_to_probs(logits, params), _reference(logits, params)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), f"trial {trial}: rows differ: {(got != want).any(dim=1).nonzero().tolist()}"


def test_uniform_batches_take_each_shortcut_and_still_match():
    """Batches where every row shares one switch, so each skip (all greedy, none cut, all top-k, ...) runs."""
    gen = torch.Generator().manual_seed(1)
    vocab, n = 300, 6
    cases = [dict(t=0.0), dict(t=0.8), dict(t=0.8, k=10), dict(t=0.8, p=0.7), dict(t=1.3, m=0.05),
             dict(t=0.9, k=40, p=0.8, m=0.02)]
    for c in cases:
        params = SamplingBatch.from_lists([c["t"]] * n, [c.get("k", -1)] * n, [c.get("p", 1.0)] * n,
                                          [c.get("m", 0.0)] * n)
        logits = _random_logits(gen, n, vocab)
        assert torch.equal(logits_to_probs(logits, params), _reference(logits, params)), c


def test_a_row_alone_equals_the_row_in_a_mixed_batch():
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    vocab, n = 512, 12
    logits, params = _random_logits(gen, n, vocab), _random_params(rng, n, vocab)
    batch = logits_to_probs(logits, params)
    for i in range(n):
        one = SamplingBatch(params.temperature[i:i + 1], params.top_k[i:i + 1], params.top_p[i:i + 1],
                            params.min_p[i:i + 1])
        assert torch.equal(logits_to_probs(logits[i:i + 1], one), batch[i:i + 1]), i


def test_sorted_descending_equals_torch_sort_values():
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (5, 1000), generator=gen).float()
    x[1, ::7] = float("-inf")
    assert torch.equal(_sorted_descending(x), x.sort(dim=-1, descending=True, stable=True).values)
    assert torch.equal(_sorted_descending(x[:, ::2]), x[:, ::2].sort(dim=-1, descending=True).values)


def test_top_p_boundary_mass_exactly_top_p_drops_the_token():
    """The mass before a token equal to top_p (to the bit) drops it: random data rarely hits this boundary."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sorted_p = torch.softmax(logits, dim=-1)
    top_p = float((sorted_p.cumsum(dim=-1) - sorted_p)[0, 1])  # the mass before the second token
    params = SamplingBatch.from_lists([1.0], [-1], [top_p], [0.0])
    got = logits_to_probs(logits, params)
    assert torch.equal(got, _reference(logits, params))
    assert got[0].tolist() == [1.0, 0.0, 0.0, 0.0]
