"""The choice between pipelined and sequential steps (engine/drafting/pipeline_switch.py), on synthetic step costs."""

from __future__ import annotations

import random

from engine.drafting.pipeline_switch import PIPELINED, SEQUENTIAL, PipelineSwitch, regime


def _drive(sw: PipelineSwitch, key, cost: dict[bool, float], steps: int) -> list[bool]:
    """Run ``steps`` steps whose seconds per token are ``cost[mode]``; the modes chosen."""
    modes, last = [], None
    for _ in range(steps):
        m = sw.choose(key)
        sw.observe(key, m, m == last, cost[m] * 3, 3)
        modes.append(m)
        last = m
    return modes


def test_regime_buckets_are_the_cost_curves_octaves():
    assert [regime(False, b)[1] for b in (1, 2, 3, 4, 5, 8, 11, 12, 16)] == [0, 1, 2, 2, 2, 3, 3, 4, 4]
    assert regime(True, 1) != regime(False, 1)


def test_turns_pipelining_off_where_it_cannot_pay_and_on_where_it_does():
    sw = PipelineSwitch()
    key = regime(False, 8)
    modes = _drive(sw, key, {PIPELINED: 1.3, SEQUENTIAL: 1.0}, 200)
    # After learning both, sequential; the pipelined steps left are the learning and the exploration bursts.
    assert modes[-1] is SEQUENTIAL and sum(modes[20:]) / len(modes[20:]) < 0.12
    # Pipelining becomes cheaper: an exploration burst notices and the regime turns it back on.
    modes = _drive(sw, key, {PIPELINED: 0.7, SEQUENTIAL: 1.0}, 100)
    assert modes[-1] is PIPELINED and sum(modes[-20:]) >= 17
    # Another regime is learned apart.
    assert sum(_drive(sw, regime(True, 1), {PIPELINED: 0.8, SEQUENTIAL: 1.0}, 60)[-20:]) >= 15


def test_exploring_a_much_costlier_mode_spends_little_time():
    sw = PipelineSwitch()
    key = regime(True, 8)
    cost = {PIPELINED: 3.0, SEQUENTIAL: 1.0}
    modes = _drive(sw, key, cost, 1000)
    assert modes[:3] == [SEQUENTIAL] * 3 and sum(modes[:10]) <= 2  # learning gave up after one steady step
    spent = [cost[m] for m in modes[10:]]
    assert sum(c for c, m in zip(spent, modes[10:], strict=True) if m) / sum(spent) < 2.5 * sw.config.explore_budget


def test_hysteresis_near_equal_modes_do_not_flap():
    sw = PipelineSwitch()
    key = regime(False, 1)
    rng = random.Random(0)
    last = None
    for _ in range(300):  # equal modes, each step +-3 % noise: within the margin
        m = sw.choose(key)
        sw.observe(key, m, m == last, 3 * rng.uniform(0.97, 1.03), 3)
        last = m
    (row,) = sw.as_dict().values()
    assert row["switches"] == 0 and row["mode"] == "sequential"  # the tie goes to the mode that costs no core


def test_disabled_is_always_pipelined_and_force_overrides():
    sw = PipelineSwitch(enabled=False)
    assert all(_drive(sw, regime(False, 8), {PIPELINED: 9.0, SEQUENTIAL: 1.0}, 50))
    sw = PipelineSwitch(force=lambda i: i % 2 == 0)
    assert _drive(sw, regime(False, 8), {PIPELINED: 1.0, SEQUENTIAL: 1.0}, 4) == [True, False, True, False]
