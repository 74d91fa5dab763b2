"""Verification and proposal on hand-made inputs (workers/verification.py, workers/proposal.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from workers.proposal import ProposalMode, draw_children, draw_children_batch, draw_children_many
from workers.verification import (
    CandidateTree,
    VerifyResult,
    pad_draft_probs,
    residual_distribution,
    truncate_at_stop,
    verify_batch,
    verify_greedy,
    verify_tree,
    verify_tree_batch,
)

A, B, C = 0, 1, 2
P3 = (Fraction(1, 2), Fraction(3, 10), Fraction(1, 5))
Q3 = (Fraction(3, 5), Fraction(1, 10), Fraction(3, 10))


def fraction_step(p: tuple[Fraction, ...], q: tuple[Fraction, ...]):
    """Exact single-step rule: x ~ q accepted w.p. min(1, p/q); on rejection draw from norm(max(0, p - q))."""
    accepted = tuple(qx * min(Fraction(1), px / qx) if qx else Fraction(0) for px, qx in zip(p, q, strict=True))
    acceptance = sum(accepted, Fraction(0))
    diff = tuple(max(Fraction(0), px - qx) for px, qx in zip(p, q, strict=True))
    mass = sum(diff, Fraction(0))
    residual = tuple(d / mass for d in diff) if mass else None
    return accepted, acceptance, residual


def _t(values) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def test_worked_three_token_example_exactly() -> None:
    accepted, acceptance, residual = fraction_step(P3, Q3)
    assert accepted == (Fraction(1, 2), Fraction(1, 10), Fraction(1, 5))
    assert acceptance == Fraction(4, 5)
    assert residual == (0, 1, 0)
    # Accepted mass plus rejected mass times the residual gives back p: the step is lossless.
    assert tuple(a + (1 - acceptance) * r for a, r in zip(accepted, residual, strict=True)) == P3

    # The torch implementation agrees on the same numbers.
    p, q = _t(P3), _t(Q3)
    assert torch.allclose(q * torch.clamp(p / q, max=1), _t(accepted), atol=1e-7)
    assert torch.allclose(residual_distribution(p, q), _t(residual), atol=1e-7)
    # And accepts exactly below the thresholds min(1, p/q) = 5/6, 1, 2/3.
    for tok, threshold in ((A, Fraction(5, 6)), (B, Fraction(1)), (C, Fraction(2, 3))):
        assert threshold == min(Fraction(1), P3[tok] / Q3[tok])
        tree = CandidateTree.chain(torch.tensor([tok]), q.unsqueeze(0))
        below = verify_tree(tree, p.expand(2, 3), None, uniforms=[float(threshold) - 1e-4, 0.5])
        assert below.num_accepted == 1
        if threshold < 1:
            above = verify_tree(tree, p.expand(2, 3), None, uniforms=[float(threshold) + 1e-4, 0.5])
            assert above.num_accepted == 0 and above.tokens == [B]  # the residual is all on B


def test_fixed_replay_emits_a_then_recovered_b() -> None:
    # Chain A, C, B drawn from q; draws 0.7 (< 5/6: accept A), 0.9 (>= 2/3: reject C), 0.2 (B, never tried),
    # final 0.2 drawn from the residual (0, 1, 0): B. C and B are discarded.
    assert Fraction(7, 10) < Fraction(5, 6) and Fraction(9, 10) >= Fraction(2, 3)
    p, q = _t(P3), _t(Q3)
    tree = CandidateTree.chain(torch.tensor([A, C, B]), q.expand(3, 3).clone())
    res = verify_tree(tree, p.expand(4, 3).clone(), None, uniforms=[0.7, 0.9, 0.2, 0.2])
    assert res == VerifyResult(accepted_nodes=[0], tokens=[A, B], num_accepted=1, bonus=False)
    # All accepted: a bonus token from p (u = 0.2 falls in A's mass 0.5).
    res = verify_tree(tree, p.expand(4, 3).clone(), None, uniforms=[0.7, 0.1, 0.2, 0.2])
    assert res == VerifyResult(accepted_nodes=[0, 1, 2], tokens=[A, C, B, A], num_accepted=3, bonus=True)


def test_tree_siblings_are_tried_against_the_running_residual() -> None:
    # Root children: C then A (i.i.d. from q). C rejected (u 0.9 >= 2/3): r := norm(max(0, p - q)) = (0, 1, 0),
    # so A (r(A) = 0) is rejected whatever its draw, and the recovered token is B.
    p, q = _t(P3), _t(Q3)
    tree = CandidateTree(torch.tensor([C, A]), torch.tensor([-1, -1]), q.expand(2, 3).clone())
    res = verify_tree(tree, p.expand(3, 3).clone(), None, uniforms=[0.9, 0.0, 0.6])
    assert res == VerifyResult([], [B], 0, False)
    # C accepted: descend into it even though A would also have been accepted.
    res = verify_tree(tree, p.expand(3, 3).clone(), None, uniforms=[0.1, 0.0, 0.6])
    assert res == VerifyResult([0], [C, B], 1, True)  # C is a leaf: bonus from p, u = 0.6 -> B


def test_p_equal_q_accepts_everything_without_nan() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        q = torch.softmax(torch.randn(4, 6, generator=gen), dim=-1)
        toks = torch.multinomial(q, 1, generator=gen).squeeze(1)
        res = verify_tree(CandidateTree.chain(toks, q), torch.cat([q, q[:1]]), gen)
        assert res.num_accepted == 4 and res.bonus
    # u is always < 1, so even the largest float below 1 accepts when r(x) == q(x).
    q = torch.tensor([[0.3, 0.7]])
    res = verify_tree(CandidateTree.chain(torch.tensor([1]), q), q.expand(2, 2), None, uniforms=[1 - 2**-24, 0.1])
    assert res.num_accepted == 1


def test_zero_residual_mass_falls_back_without_nan() -> None:
    # p sums to slightly less than q (rounding): r <= q everywhere, so max(0, r - q) has no mass.
    p = torch.tensor([0.4999, 0.5])
    q = torch.tensor([0.5, 0.5])
    res_dist = residual_distribution(p, q)
    assert torch.isfinite(res_dist).all() and torch.equal(res_dist, p)
    tree = CandidateTree.chain(torch.tensor([0]), q.unsqueeze(0))
    res = verify_tree(tree, p.expand(2, 2).clone(), None, uniforms=[0.99995, 0.9])
    assert res.num_accepted == 0 and res.tokens == [1]


def test_candidate_with_zero_draft_probability_is_rejected_loudly() -> None:
    q = torch.tensor([[0.5, 0.5, 0.0]])
    tree = CandidateTree.chain(torch.tensor([2]), q)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_tree(tree, torch.full((2, 3), 1 / 3), None)


def test_empty_tree_emits_one_token_from_p() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    res = verify_tree(CandidateTree.empty(4), p, torch.Generator().manual_seed(0))
    assert res == VerifyResult([], [2], 0, True)


def test_bad_shapes_and_vocab_mismatch() -> None:
    with pytest.raises(ValueError, match="topological"):
        verify_tree(CandidateTree(torch.tensor([0, 1]), torch.tensor([1, -1]), torch.full((2, 2), 0.5)),
                    torch.full((3, 2), 0.5), None)
    tree = CandidateTree.chain(torch.tensor([0]), torch.full((1, 2), 0.5))
    with pytest.raises(ValueError, match="pad_draft_probs"):
        verify_tree(tree, torch.full((2, 3), 1 / 3), None)
    with pytest.raises(ValueError, match=r"\[2, vocab\]"):
        verify_tree(tree, torch.full((3, 2), 0.5), None)


def test_pad_draft_probs() -> None:
    q = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    padded = pad_draft_probs(q, 4)
    assert torch.equal(padded, torch.tensor([[0.25, 0.75, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    assert pad_draft_probs(q, 2) is q
    with pytest.raises(ValueError, match="draft vocab 2 .* target vocab 1"):
        pad_draft_probs(q, 1)
    # A padded draft verifies against the larger target vocab.
    tree = CandidateTree.chain(torch.tensor([1]), pad_draft_probs(q[:1], 4))
    res = verify_tree(tree, torch.full((2, 4), 0.25), None, uniforms=[0.0, 0.9])
    assert res.tokens == [1, 3]


def test_truncate_at_stop() -> None:
    assert truncate_at_stop([5, 6, 7, 8], {7}, 10) == ([5, 6, 7], True)
    assert truncate_at_stop([5, 6, 7, 8], {7}, 2) == ([5, 6], False)
    assert truncate_at_stop([5, 6, 7, 8], {7}, 3) == ([5, 6, 7], True)
    assert truncate_at_stop([5, 6, 7, 8], set(), 10) == ([5, 6, 7, 8], False)
    assert truncate_at_stop([7, 7], {7}, 5) == ([7], True)
    assert truncate_at_stop([5], {7}, 0) == ([], False)
    with pytest.raises(ValueError):
        truncate_at_stop([5], {7}, -1)


def _random_tree(gen: torch.Generator, vocab: int) -> CandidateTree:
    n = int(torch.randint(1, 9, (1,), generator=gen))
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    q = torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1)
    return CandidateTree(tokens, torch.tensor(parents), q)


def test_verify_greedy_agrees_with_verify_tree_on_one_hot_p() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 3  # small, so candidates often match the argmax
    for _ in range(200):
        tree = _random_tree(gen, vocab)
        best = torch.randint(0, vocab, (tree.num_nodes + 1,), generator=gen)
        one_hot = torch.nn.functional.one_hot(best, vocab).float()
        assert verify_greedy(tree, best) == verify_tree(tree, one_hot, gen)


def test_verify_batch_equals_one_tree_at_a_time_with_the_same_seeds() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 6
    trees = [_random_tree(gen, vocab) for _ in range(12)]
    trees += [CandidateTree.chain(t.tokens, t.draft_probs) for t in trees[:6]]  # repeated shapes group up
    trees.append(CandidateTree.empty(vocab))
    probs = [torch.softmax(torch.randn(t.num_nodes + 1, vocab, generator=gen), dim=-1) for t in trees]
    seeds = list(range(len(trees)))
    batched = verify_batch(trees, probs, [torch.Generator().manual_seed(s) for s in seeds])
    alone = [verify_tree(t, p, torch.Generator().manual_seed(s)) for t, p, s in zip(trees, probs, seeds, strict=True)]
    assert batched == alone


def test_absent_nodes_behave_as_if_the_tree_had_no_such_node() -> None:
    # Node 1 (a second root child) and its child node 2 are absent (-1) in the padded tree.
    q = torch.tensor([[0.2, 0.5, 0.3]])
    p = torch.tensor([[0.6, 0.1, 0.3]])
    padded = verify_tree_batch(
        [-1, -1, 1],
        torch.tensor([[1, -1, 0]]),
        torch.cat([q, torch.zeros(1, 3), q]).unsqueeze(0),
        p.expand(4, 3).unsqueeze(0),
        torch.tensor([[0.9, 0.0, 0.0, 0.5]]),
    ).to_results()[0]
    plain = verify_tree(CandidateTree.chain(torch.tensor([1]), q), p.expand(2, 3), None, uniforms=[0.9, 0.5])
    assert padded == plain and plain.num_accepted == 0


@pytest.mark.parametrize("mode", list(ProposalMode))
def test_draw_children_laws_cover_their_tokens(mode: ProposalMode) -> None:
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        q = torch.softmax(torch.randn(8, generator=gen) * 2, dim=-1)
        q[torch.randint(0, 8, (3,), generator=gen)] = 0.0
        q = q / q.sum()
        support = int((q > 0).sum())
        toks, laws = draw_children(q, 6, mode.value, gen)
        assert laws.shape == (len(toks), 8)
        assert (laws[torch.arange(len(toks)), toks] > 0).all()
        assert torch.allclose(laws.sum(dim=-1), torch.ones(len(toks)))
        if mode is ProposalMode.IID:
            assert len(toks) == 6 and torch.equal(laws, q.expand(6, 8))
        else:
            assert len(toks) == min(6, support) and len(set(toks.tolist())) == len(toks)
        if mode is ProposalMode.WITHOUT_REPLACEMENT:
            for i in range(len(toks)):
                expect = q.clone()
                expect[toks[:i]] = 0
                assert torch.allclose(laws[i], expect / expect.sum(), atol=1e-6)
        if mode is ProposalMode.DETERMINISTIC:
            assert torch.equal(laws, torch.nn.functional.one_hot(toks, 8).float())


def test_deterministic_children_are_top_k_lowest_id_on_ties() -> None:
    q = torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.2, 0.0]])
    toks, _ = draw_children_batch(q, 7, "deterministic")
    assert toks.tolist() == [[1, 3, 4, 0, 2, -1, -1]]
    with pytest.raises(ValueError):
        draw_children(q[0], 2, "greedy", None)


def test_without_replacement_draws_follow_sequential_laws() -> None:
    # P(first = x, second = y) = q(x) q(y) / (1 - q(x)); check the pair law on 3 tokens.
    q = torch.tensor([0.5, 0.3, 0.2])
    n = 20000
    toks, _ = draw_children_many(q.expand(n, 3), 2, ProposalMode.WITHOUT_REPLACEMENT,
                                 [torch.Generator().manual_seed(7)] * n)
    freq = torch.bincount(toks[:, 0] * 3 + toks[:, 1], minlength=9).double() / n
    exact = torch.tensor([[0.0 if x == y else float(q[x] * q[y] / (1 - q[x])) for y in range(3)] for x in range(3)])
    # 4 binomial standard errors at n = 20000 is at most 0.014.
    assert torch.allclose(freq, exact.flatten().double(), atol=0.015)
