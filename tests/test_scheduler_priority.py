"""Priority admission (issue 12): batch work (priority 1) yields to online requests (priority 0)."""

from __future__ import annotations

from tests.test_scheduler import make_req, make_sched, play


def _req(seq_id: int, priority: int, prompt_len: int = 4, max_tokens: int = 8):
    r = make_req(seq_id, prompt_len, max_tokens)
    r.priority = priority
    return r


def test_waiting_queue_orders_by_priority_then_arrival() -> None:
    s = make_sched()
    for i, p in enumerate([1, 1, 0, 1, 0]):
        s.add(_req(i, p))
    assert [r.seq_id for r in s.waiting] == [2, 4, 0, 1, 3]


def test_an_online_request_takes_a_slot_from_a_full_set_of_batch_work() -> None:
    s = make_sched(max_seqs=2)
    batch = [_req(i, 1) for i in range(4)]
    for r in batch:
        s.add(r)
    play(s, s.schedule())
    assert {r.seq_id for r in s.running} == {0, 1}
    online = _req(10, 0)
    s.add(online)
    out = s.schedule()
    assert online in s.running and [c.req for c in out.prefills] == [online]  # admitted in this very step
    assert [r.seq_id for r in out.preempted] == [1]  # the newest batch request yields
    assert [r.seq_id for r in s.waiting][:1] == [1]  # and goes back ahead of the batch work that never ran
    play(s, out)


def test_batch_work_never_preempts_online_work() -> None:
    s = make_sched(max_seqs=2)
    online = [_req(i, 0) for i in range(2)]
    for r in online:
        s.add(r)
    play(s, s.schedule())
    s.add(_req(5, 1))
    out = s.schedule()
    assert not out.preempted and set(s.running) == set(online)


def test_a_short_kv_pool_preempts_the_lowest_priority_first() -> None:
    # 6 blocks of 4: two requests of 8-token prompts fill the pool once they decode.
    s = make_sched(num_blocks=6, block_size=4, max_seqs=4)
    old_batch, new_online = _req(0, 1, prompt_len=8, max_tokens=12), _req(1, 0, prompt_len=8, max_tokens=12)
    s.add(old_batch)
    s.add(new_online)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished:
            break
        out = s.schedule()
        preempted += out.preempted
        play(s, out)
    assert preempted and all(r is old_batch for r in preempted)
