"""Pipelining's outcome choice (workers/outcome_choice.py, engine/drafting/pipelined_drafter.py OutcomeCosts): which
outcomes of the round in flight get a pre-drafted tree, by expected value against cost."""

from __future__ import annotations

import math

import torch

from engine.drafting.pipelined_drafter import HIDDEN_COST, OutcomeCosts
from workers.outcome_choice import choose_outcomes


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs])  # [V]


# Three outcome points of a K=2 chain: rejected at depth 0 (the draft tried token 0 there), rejected at depth 1
# (tried token 1), all accepted. P(j): 0.1, 0.3, 0.6 (per-position acceptance 0.9, then 2/3).
Q0 = [0.7, 0.2, 0.1, 0.0]  # at depth 0 without token 0: 2/3, 1/3
Q1 = [0.1, 0.5, 0.3, 0.1]  # at depth 1 without token 1: tokens 0, 2, 3 -> 0.2, 0.6, 0.2
QL = [0.05, 0.05, 0.5, 0.4]  # at the leaf (bonus): 0.05, 0.05, 0.5, 0.4
ROWS = [_logits(Q0), _logits(Q1), _logits(QL)]
W = [0.1, 0.3, 0.6]
EXCL = [[0], [1], []]
# Values P(j) x q~(t): (2, 2) 0.30, (2, 3) 0.24, (1, 2) 0.18, (0, 1) 0.0667, (1, 0) 0.06, (1, 3) 0.06, ...


def test_best_outcomes_by_expected_value():
    got = choose_outcomes(ROWS, W, EXCL, temperature=1.0, budget=3, min_value=0.0)
    assert [(i, t) for i, t, _ in got] == [(2, 2), (2, 3), (1, 2)]
    assert [round(v, 4) for _, _, v in got] == [0.3, 0.24, 0.18]


def test_the_residual_excludes_the_tried_token():
    # Rejected at depth 1: the residual has no mass on token 1 (the draft's own choice), so q is renormalised
    # without it: token 2 0.3 / 0.5 = 0.6, tokens 0 and 3 0.2 each (a tie: the lower id first).
    got = choose_outcomes(ROWS[1:2], [1.0], [[1]], temperature=1.0, budget=3, min_value=0.0)
    assert [t for _, t, _ in got] == [2, 0, 3]
    assert [round(v, 4) for _, _, v in got] == [0.6, 0.2, 0.2]


def test_how_many_is_set_by_value_vs_cost():
    # Only outcomes worth at least min_value past the first: 0.2 keeps two, 0.5 keeps only the best (always
    # kept: without it pipelining has nothing to hit), the budget caps the rest.
    assert len(choose_outcomes(ROWS, W, EXCL, 1.0, budget=8, min_value=0.2)) == 2
    assert len(choose_outcomes(ROWS, W, EXCL, 1.0, budget=8, min_value=0.5)) == 1
    assert len(choose_outcomes(ROWS, W, EXCL, 1.0, budget=8, min_value=0.0)) == 8
    assert choose_outcomes(ROWS, W, EXCL, 1.0, budget=0, min_value=0.0) == []


def test_a_draft_that_is_rarely_accepted_predrafts_early_rejections():
    got = choose_outcomes(ROWS, [0.9, 0.08, 0.02], EXCL, 1.0, budget=2, min_value=0.0)
    assert [(i, t) for i, t, _ in got] == [(0, 1), (0, 2)]


def test_temperature_sharpens_the_estimate_and_greedy_reads_q_at_one():
    hot = choose_outcomes(ROWS[2:], [1.0], [[]], temperature=2.0, budget=2, min_value=0.0)
    cold = choose_outcomes(ROWS[2:], [1.0], [[]], temperature=0.5, budget=2, min_value=0.0)
    assert hot[0][2] < 0.5 < cold[0][2]
    greedy = choose_outcomes(ROWS[2:], [1.0], [[]], temperature=0.0, budget=2, min_value=0.0)
    assert [round(v, 4) for _, _, v in greedy] == [0.5, 0.4]


def test_costs_marginal_tree_time_over_the_redraft_it_saves():
    c = OutcomeCosts()
    assert c.min_value() == 0.0  # nothing measured: the whole budget
    for i in range(40):  # pre-draft 2 ms + 1 ms per outcome; re-draft 8 ms for 2 sequences
        n = 1 + i % 4
        c.observe_predraft(0.002 + 0.001 * n, n)
        c.observe_redraft(0.008, 2)
        c.observe_verify(0.020)  # verification outlasts every pre-draft: hidden, charged HIDDEN_COST
    a, b = c.line()
    assert abs(a - 0.002) < 1e-9 and abs(b - 0.001) < 1e-9
    assert abs(c.min_value() - HIDDEN_COST * 0.001 / 0.004) < 1e-9
    for _ in range(60):
        c.observe_verify(0.001)  # now every pre-draft is exposed: the full marginal cost
    assert abs(c.min_value() - 0.001 / 0.004) < 1e-9
