"""The pipelining simulator (benchmarks/sim_model.py, trace.py) on hand-made traces with known answers."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from benchmarks.sim_model import CostModel, break_even, hits_by_accepted, replay, shape
from benchmarks.simulate import GPU_COSTS
from benchmarks.simulate import main as simulate_main
from benchmarks.trace import RoundTrace, Step, TraceDrafter, read_trace
from workers.messages import DraftTree, TargetStepOutput, VerifyResult

# draft 1 ms a level, verify 4 ms, pre-draft 1 ms a level (depth 4 + 1 = 5 ms), nothing else:
# sequential 4 + 4 = 8 ms a step; pipelined hit max(4, 5) = 5 ms, miss 4 + 5 = 9 ms.
UNIT = CostModel("unit", draft_fixed_ms=0.0, draft_ms_per_level=1.0, verify_fixed_ms=4.0, verify_ms_per_token=0.0,
                 predraft_ms_per_level=1.0)


def steps(hits: list[list[bool]], emitted: int = 3) -> list[Step]:
    """One step per entry, one depth-4 round per request in it."""
    return [Step(rounds=[RoundTrace(seq=i, drafted=4, accepted=emitted - 1, emitted=emitted, hit=h)
                         for i, h in enumerate(row)]) for row in hits]


def test_replay_known_times():
    r = replay(steps([[False], [True], [True], [True]]), UNIT)
    assert r.tokens == 12
    assert r.sequential_s == pytest.approx(4 * 8e-3)
    assert r.pipelined_s == pytest.approx((9 + 5 + 5 + 5) * 1e-3)
    assert r.hidden_s == pytest.approx(4 * 4e-3)  # verify alone
    assert r.hit_rate == pytest.approx(0.75)
    assert r.pipelined_tok_s == pytest.approx(12 / 24e-3)
    # never waiting: the missed first round verifies no tree (1 token), every step takes max(4, 5) ms
    assert (r.nowait_tokens, r.nowait_s) == (1 + 3 * 3, pytest.approx(4 * 5e-3))


def test_break_even_known_answers():
    one = [shape(s) for s in steps([[True]] * 4)]
    assert break_even(one, UNIT) == pytest.approx(0.25, abs=1e-6)  # 9 - 4h = 8
    slow = CostModel(**{**UNIT.__dict__, "overlap_slowdown": 0.5})  # verify 6: hit 6, miss 10; 10 - 4h = 8
    assert break_even(one, slow) == pytest.approx(0.5, abs=1e-6)
    two = [shape(s) for s in steps([[True, True]] * 4)]  # a step saves the re-draft only if both hit: 9 - 4h^2 = 8
    assert break_even(two, UNIT) == pytest.approx(0.5, abs=1e-6)
    never = CostModel(**{**UNIT.__dict__, "predraft_ms_per_level": 3.0})  # a hit step alone takes 15 > 8
    assert break_even(one, never) is None
    free = CostModel(**{**UNIT.__dict__, "predraft_ms_per_level": 0.5})  # miss 4 + 4 = 8: pays at any hit rate
    assert break_even(one, free) == 0.0


def test_messaging_and_state_counted_per_hop():
    c = CostModel(**{**UNIT.__dict__, "msg_ms": 0.5, "state_ms": 1.0, "hit_propose_ms": 0.25})
    r = replay(steps([[True], [False]]), c)
    assert r.sequential_s == pytest.approx(2 * (4 + 1 + 4 + 1 + 1) * 1e-3)
    hit, miss = 0.25 + max(4 + 1, 5 + 1) + 1, 4 + 1 + max(4 + 1, 5 + 1) + 1
    assert r.pipelined_s == pytest.approx((hit + miss) * 1e-3)


def test_prefill_steps_always_miss():
    s = Step(rounds=[], prefill_tokens=7)
    assert shape(s).missed and shape(s).tokens == 7


def test_cost_model_rejects_bad_numbers():
    with pytest.raises(ValueError, match="verify_fixed_ms"):
        CostModel("x", 0.0, 1.0, -1.0, 0.0, 1.0)
    assert GPU_COSTS["gpu"].overlap_slowdown == 0.0


def test_trace_drafter_records_rounds_and_hits():
    class Inner:
        stats = SimpleNamespace(draft_busy_s=0.0)

        def has_tree(self, seq_id):
            return seq_id == 1

        def propose(self, batch, gone):
            return [DraftTree([5, 6], [-1, 0], 0, 1, [0, 1]), DraftTree([7], [-1], 0, 0, [0])]

        def overlap(self, batch, trees):
            pass

        def commit(self, batch, trees, out):  # like the pipelined drafter: the pre-draft's time, once waited for
            self.stats.draft_busy_s += 0.002
            return {}

    batch = SimpleNamespace(rounds=[SimpleNamespace(seq_id=0), SimpleNamespace(seq_id=1)],
                            prefills=[SimpleNamespace(start=0, end=3)])
    out = TargetStepOutput({}, [VerifyResult([0, 1], [5, 6, 9], 2, True), VerifyResult([], [8], 0, False)], 0.01)
    buf = io.StringIO()
    d = TraceDrafter(Inner(), buf)
    trees = d.propose(batch, [])
    d.overlap(batch, trees)
    d.commit(batch, trees, out)
    rec = json.loads(buf.getvalue())
    got = Step.from_json(rec)
    assert [(r.seq, r.drafted, r.accepted, r.emitted, r.hit) for r in got.rounds] == [(0, 2, 2, 3, False),
                                                                                      (1, 1, 0, 1, True)]
    assert got.prefill_tokens == 3 and got.verify_s == 0.01 and got.predraft_s == pytest.approx(0.002)


def test_replay_cli_on_a_trace_file(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "header", "temperature": 0.0, "batch": 1}) + "\n")
        for s in steps([[False], [True]]):
            f.write(json.dumps(s.as_json()) + "\n")
    header, got = read_trace(str(path))
    assert header["batch"] == 1 and len(got) == 2
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"cost_model": UNIT.__dict__}))
    assert simulate_main(["replay", str(path), "--costs", f"gpu,{costs}"]) == 0
    table = capsys.readouterr().out
    assert "cost model unit" in table and "0.25" in table  # break-even of the unit model on this trace


def test_hits_by_accepted_pairs_each_round_with_the_previous_one_of_its_request():
    def rt(seq, acc, hit):
        return RoundTrace(seq=seq, drafted=4, accepted=acc, emitted=acc + 1, hit=hit)

    trace = [Step([rt(0, 4, False), rt(1, 1, False)]),  # first rounds: nothing before them
             Step([rt(0, 2, True), rt(1, 0, False)]),  # after 4 accepted: hit; after 1: miss
             Step([rt(0, 4, True), rt(1, 4, True)])]  # after 2: hit; after 0: hit
    assert hits_by_accepted(trace) == {0: (1, 1), 1: (0, 1), 2: (1, 1), 4: (1, 1)}


def test_record_and_calibrate_on_the_builtin_pair(tmp_path, capsys):
    """``record`` traces real runs of the engine (a chain, then pipelined), ``calibrate`` fits the CPU cost model
    from the two traces and compares simulated with measured tokens/s."""
    traces = {}
    for mode in ("chain", "pipelined"):
        traces[mode] = tmp_path / f"{mode}.jsonl"
        assert simulate_main(["record", "--mode", mode, "--num-prompts", "2", "--max-tokens", "12",
                              "--out", str(traces[mode])]) == 0
    for mode, path in traces.items():
        header, got = read_trace(str(path))
        assert header["mode"] == mode
        spec_rounds = [r for s in got for r in s.rounds if r.drafted]
        assert spec_rounds and all(1 <= r.drafted <= 4 and r.accepted <= r.drafted and r.emitted == r.accepted + 1
                                   for r in spec_rounds)
        assert all((r.hit is None) == (mode == "chain") for r in spec_rounds)
        # every token of the run comes from a prefill or a round: 2 prompts x 12 tokens
        assert sum(r.emitted for s in got for r in s.rounds) + sum(1 for s in got if s.prefill_tokens) >= 2 * 12
    out = tmp_path / "fit.json"
    assert simulate_main(["calibrate", "--chain", str(traces["chain"]), "--pipelined", str(traces["pipelined"]),
                          "--json", str(out)]) == 0
    fit = json.loads(out.read_text())
    assert fit["cost_model"]["name"] == "cpu" and fit["cost_model"]["verify_fixed_ms"] > 0
    assert all(fit[k]["chain"] > 0 and fit[k]["pipelined"] > 0 for k in ("measured", "simulated"))
    assert "pipelined" in capsys.readouterr().out
