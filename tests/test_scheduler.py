"""Scheduler and block accounting on hand-made requests (pure Python: no model runs).

``play`` stands in for the workers: it makes up a round's results (``accept`` nodes accepted, accept + 1 tokens)
and applies them through the scheduler's own ``update_from_output``, then emits the tokens.
"""

from __future__ import annotations

import random

import pytest

from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from workers.messages import VerifyResult


def make_req(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Request:
    req = Request(seq_id, str(seq_id), list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    req.stats.arrival_time = float(seq_id)  # arrival order == seq_id order, whatever the clock does
    return req


def make_sched(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8, nodes: int = 0,
               draft: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockManager(num_blocks, block_size),
                     BlockManager(num_blocks, block_size) if draft else None, nodes)


def play(sched: Scheduler, batch: ScheduledBatch, accept: int = 0) -> list[Request]:
    """Apply made-up results of a batch through the scheduler; returns the requests that finished."""
    for c in batch.prefills:
        assert c.start == c.req.num_cached_target
    results, drafted, cached_draft = [], [], {}
    for r in batch.rounds:
        n = min(accept, r.remaining_tokens - 1, sched.num_tree_nodes)
        results.append(VerifyResult(list(range(n)), [7] * (n + 1), n, n == sched.num_tree_nodes))
        drafted.append(sched.num_tree_nodes)
        if sched.draft_blocks is not None:
            cached_draft[r.seq_id] = r.num_tokens + n
    sched.update_from_output(batch, results, drafted, cached_draft)
    for c in batch.prefills:
        if c.completes_prefill and not c.req.output_token_ids:
            c.req.output_token_ids.append(7)  # the first token, sampled at the end of the prompt
    for r, res in zip(batch.rounds, results, strict=True):
        r.output_token_ids += res.tokens
    done = []
    for r in [c.req for c in batch.prefills] + batch.rounds:
        if r.output_token_ids and r.remaining_tokens <= 0 and not r.finished:
            sched.finish(r, FinishReason.LENGTH)
            done.append(r)
    return done


def owned_blocks(bm: BlockManager) -> list[int]:
    return [b for t in bm.tables.values() for b in t]


def assert_accounting(bm: BlockManager) -> None:
    owned = owned_blocks(bm)
    assert len(owned) == len(set(owned)), "a block is owned by two tables"
    assert len(owned) + bm.num_free == bm.num_blocks, "a block is neither owned nor free"


# ------------------------------------------------------------------------------------------------ block manager
def test_block_manager_reserve_trim_free() -> None:
    bm = BlockManager(8, 4)
    assert bm.reserve(0, 5) == [0, 1] and bm.num_free == 6
    assert bm.reserve(0, 8) == [0, 1]  # already covered: nothing new
    assert bm.blocks_needed(0, 9) == 1 and len(bm.reserve(0, 9)) == 3
    assert bm.reserve(1, 1) == [3]
    assert bm.blocks_needed(1, 13) == 3 and bm.can_reserve(1, 13) and not bm.can_reserve(1, 100)
    assert_accounting(bm)
    with pytest.raises(MemoryError, match="need 24 KV blocks, 4 free"):
        bm.reserve(1, 100)
    assert bm.tables[1] == [3] and bm.num_free == 4  # a failed reserve takes nothing
    bm.trim(0, 4)  # keep the first block (4 slots) only
    assert bm.tables[0] == [0] and bm.num_free == 6
    bm.trim(0, 4)
    assert bm.tables[0] == [0]
    bm.trim(0, 0)
    assert bm.tables[0] == [] and bm.num_free == 7
    bm.trim(42, 0)  # unknown sequence: nothing to do
    bm.free(0)
    bm.free(1)
    bm.free(1)
    assert bm.num_free == 8 and not bm.tables
    assert sorted(bm.reserve(2, 32)) == list(range(8)) and bm.num_free == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)


def test_block_manager_never_leaks_under_random_use() -> None:
    rng = random.Random(0)
    bm = BlockManager(40, 3)
    for _ in range(3000):
        seq = rng.randrange(6)
        op = rng.random()
        if op < 0.5:
            n = rng.randrange(0, 40)
            if bm.can_reserve(seq, n):
                table = bm.reserve(seq, n)
                assert len(table) * 3 >= n
            else:
                with pytest.raises(MemoryError):
                    bm.reserve(seq, n)
        elif op < 0.85:
            n = rng.randrange(0, 30)
            before = len(bm.tables.get(seq, []))
            bm.trim(seq, n)
            assert len(bm.tables.get(seq, [])) == min(before, -(-n // 3))
        else:
            bm.free(seq)
            assert seq not in bm.tables
        assert_accounting(bm)
    for seq in range(6):
        bm.free(seq)
    assert bm.num_free == bm.num_blocks


def test_a_used_pool_still_hands_out_blocks_in_ascending_runs() -> None:
    """After many sequences were freed in scrambled order (the adaptive start-up profiling runs up to 64 at once),
    a new sequence's blocks are the lowest free ones in order, as from a fresh pool: handed out in the order they
    were freed, its context lay scattered and every later forward's gather of it was 5-20 % slower."""
    bm = BlockManager(64, 4)
    rng = random.Random(0)
    for seq in range(16):
        bm.reserve(seq, 4 * rng.randrange(1, 5))
    order = list(range(16))
    rng.shuffle(order)
    for seq in order:
        bm.trim(seq, 4)  # some blocks back early, the rest with the sequence
        bm.free(seq)
    assert bm.reserve(100, 4 * 10) == list(range(10))
    bm.reserve(101, 4 * 3)
    bm.free(100)
    assert bm.reserve(102, 4 * 12) == [*range(10), 13, 14]


# ---------------------------------------------------------------------------------------------------- admission
def test_admission_in_arrival_order_up_to_max_num_seqs() -> None:
    sched = make_sched(max_seqs=2)
    a, b, c = make_req(0, 3, max_tokens=1), make_req(1, 3), make_req(2, 3)
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule()
    assert [p.req for p in batch.prefills] == [a, b] and not batch.rounds
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert c.status is RequestStatus.WAITING and a.status is RequestStatus.RUNNING
    assert play(sched, batch) == [a]  # max_tokens=1: the prefill's token ends it
    batch = sched.schedule()
    assert batch.rounds == [b] and [p.req for p in batch.prefills] == [c]
    assert sched.running == [b, c] and not sched.waiting


def test_admission_does_not_skip_a_head_that_does_not_fit() -> None:
    """A long prompt at the head of the queue is not overtaken by short ones (it would starve)."""
    sched = make_sched(num_blocks=6, block_size=4)  # 24 slots
    a = make_req(0, 12)
    sched.add(a)
    play(sched, sched.schedule())  # a holds 3 blocks
    b, c = make_req(1, 16, max_tokens=4), make_req(2, 2, max_tokens=2)
    sched.add(b)
    sched.add(c)
    batch = sched.schedule()  # a's round takes a 4th block; b's 16-token prompt needs 4 of the 2 left
    assert batch.rounds == [a] and not batch.prefills
    assert list(sched.waiting) == [b, c]
    while not a.finished:
        play(sched, batch)
        batch = sched.schedule()
    assert [p.req for p in batch.prefills] == [b, c]


def test_capacity_error_names_the_sizes() -> None:
    sched = make_sched(num_blocks=4, block_size=4, nodes=3)  # 16 slots
    sched.add(make_req(0, 5, max_tokens=8))  # 5 + 8 + 3 = 16: fits exactly
    with pytest.raises(ValueError, match=r"prompt \(6 tokens\) .*max_tokens \(8\).* exceeds the KV cache capacity "
                                         r"of 16 tokens"):
        sched.add(make_req(1, 6, max_tokens=8))
    # The smaller pool decides.
    sched = Scheduler(SchedulerConfig(), BlockManager(8, 4), BlockManager(2, 4), 0)
    with pytest.raises(ValueError, match="capacity of 8 tokens"):
        sched.add(make_req(0, 5, max_tokens=4))


def test_scheduler_config_validation() -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: 0})


# ----------------------------------------------------------------------------------------------------- chunking
def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    sched = make_sched(budget=5)
    a = make_req(0, 12)
    sched.add(a)
    chunks = []
    while a.is_prefilling or not a.output_token_ids:
        batch = sched.schedule()
        assert len(batch.prefills) == 1 and not batch.rounds
        c = batch.prefills[0]
        chunks.append((c.start, c.end, c.completes_prefill))
        play(sched, batch)
    assert chunks == [(0, 5, False), (5, 10, False), (10, 12, True)]
    assert a.output_token_ids == [7] and a.num_cached_target == 12
    assert sched.schedule().rounds == [a]


def test_rounds_take_their_share_of_the_token_budget() -> None:
    sched = make_sched(budget=8, nodes=3)
    a = make_req(0, 2)
    sched.add(a)
    play(sched, sched.schedule())
    b = make_req(1, 20)
    sched.add(b)
    batch = sched.schedule()
    # a's round feeds its in-flight token and 3 tree nodes: 4 of the 8 tokens; b gets the other 4.
    assert batch.rounds == [a]
    assert [(c.start, c.end) for c in batch.prefills] == [(0, 4)]
    # Blocks cover every slot the round writes: committed, in flight and the tree.
    assert len(sched.target_blocks.tables[a.seq_id]) * 4 >= a.num_tokens + 3


# --------------------------------------------------------------------------------------------------- preemption
def test_the_newest_running_request_is_preempted_and_recomputed() -> None:
    sched = make_sched(num_blocks=5, block_size=4, draft=True, nodes=1)  # 20 slots per pool
    old, new = make_req(0, 7, max_tokens=10), make_req(1, 7, max_tokens=10)
    sched.add(old)
    sched.add(new)
    play(sched, sched.schedule())  # both prefilled: 2 blocks each (8 slots), 1 free
    assert old.output_token_ids and new.output_token_ids
    batch = sched.schedule()  # rounds need 7 + 1 + 1 = 9 slots: 3 blocks each; only one fits
    assert batch.preempted == [new] and batch.rounds == [old]
    assert new.status is RequestStatus.WAITING and list(sched.waiting) == [new] and sched.running == [old]
    assert new.num_cached_target == 0 and new.num_cached_draft == 0
    assert new.seq_id not in sched.target_blocks.tables and new.seq_id not in sched.draft_blocks.tables
    assert new.output_token_ids == [7]  # emitted tokens are kept; their KV is recomputed
    for bm in (sched.target_blocks, sched.draft_blocks):
        assert_accounting(bm)
    # The victim was not re-admitted in the step that preempted it (it would be recomputed only to be preempted
    # again); it comes back once the pool has room.
    while not any(c.req is new for c in batch.prefills):
        play(sched, batch)
        batch = sched.schedule()
    # Resumed: everything but the pending last token is recomputed, and no new first token is sampled.
    assert [(c.req, c.start, c.end, c.completes_prefill) for c in batch.prefills] == [(new, 0, 7, True)]
    assert new.prefill_end == 7 and new.num_tokens == 8
    play(sched, batch)
    assert new.output_token_ids == [7] and not new.is_prefilling
    while sched.has_unfinished:
        play(sched, sched.schedule())
    assert len(old.output_token_ids) == len(new.output_token_ids) == 10
    assert sched.target_blocks.num_free == sched.draft_blocks.num_free == 5


def test_an_older_request_preempts_the_newest_to_grow() -> None:
    sched = make_sched(num_blocks=4, block_size=4)  # 16 slots
    old, new = make_req(0, 4, max_tokens=8), make_req(1, 4, max_tokens=8)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    rounds = 0
    while not batch.preempted:
        play(sched, batch)
        batch = sched.schedule()
        rounds += 1
    # Both grew to 8 tokens (2 blocks each, the whole pool); old's 9th slot needs a block: new gives its two.
    assert rounds == 5 and old.num_tokens == 9
    assert batch.preempted == [new] and batch.rounds == [old] and list(sched.waiting) == [new]
    assert len(sched.target_blocks.tables[old.seq_id]) == 3 and sched.target_blocks.num_free == 1
    while not old.finished:
        play(sched, batch)
        batch = sched.schedule()
    assert [(c.req, c.start, c.end) for c in batch.prefills] == [(new, 0, 8)]


def test_a_round_trims_target_scratch_and_keeps_draft_scratch_for_its_commit() -> None:
    sched = make_sched(block_size=2, nodes=6, draft=True)
    a = make_req(0, 3)
    sched.add(a)
    play(sched, sched.schedule())
    batch = sched.schedule()
    assert batch.rounds == [a]
    assert len(sched.target_blocks.tables[0]) == 5 and len(sched.draft_blocks.tables[0]) == 5  # 4 + 6 slots
    play(sched, batch, accept=1)  # committed 5 tokens, 1 in flight
    assert len(sched.target_blocks.tables[0]) == 3
    # The draft still has to move its accepted nodes out of scratch at the start of its next step.
    assert len(sched.draft_blocks.tables[0]) == 5


def test_random_workload_finishes_everything_without_leaks() -> None:
    """Random prompts, budgets, acceptance and arrivals under a tight pool: invariants after every step."""
    rng = random.Random(1)
    total_preempted = 0
    for trial in range(6):
        nodes = rng.choice([0, 3, 7])
        bs = rng.choice([1, 2, 4])
        sched = make_sched(num_blocks=rng.randrange(28, 44) // bs, block_size=bs, budget=rng.randrange(4, 40),
                           max_seqs=rng.randrange(2, 7), nodes=nodes, draft=nodes > 0)
        reqs, finished = [], []
        for _ in range(2000):
            if len(reqs) < 12 and rng.random() < 0.3:
                r = make_req(len(reqs), rng.randrange(1, 14), max_tokens=rng.randrange(1, 14))
                try:
                    sched.add(r)
                    reqs.append(r)
                except ValueError:
                    pass
            if not sched.has_unfinished:
                if len(reqs) >= 12:
                    break
                continue
            batch = sched.schedule()
            total_preempted += len(batch.preempted)
            budget_used = sum(c.end - c.start for c in batch.prefills)
            assert budget_used <= sched.config.max_num_batched_tokens
            for r in batch.rounds:
                assert r.status is RequestStatus.RUNNING and not r.is_prefilling
                for bm in [sched.target_blocks] + ([sched.draft_blocks] if sched.draft_blocks else []):
                    assert len(bm.tables[r.seq_id]) * bm.block_size >= r.num_tokens + nodes
            for c in batch.prefills:
                assert c.req.status is RequestStatus.RUNNING and c.end > c.start
                assert len(sched.target_blocks.tables[c.req.seq_id]) * sched.target_blocks.block_size >= c.end
            assert len(sched.running) <= sched.config.max_num_seqs
            finished += play(sched, batch, accept=rng.randrange(0, nodes + 1))
            for bm in [sched.target_blocks] + ([sched.draft_blocks] if sched.draft_blocks else []):
                assert_accounting(bm)
        assert not sched.has_unfinished, f"trial {trial}: requests left after 2000 steps"
        assert sorted(r.seq_id for r in finished) == [r.seq_id for r in reqs]
        assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
        assert sched.target_blocks.num_free == sched.target_blocks.num_blocks
        if sched.draft_blocks is not None:
            assert sched.draft_blocks.num_free == sched.draft_blocks.num_blocks
    assert total_preempted > 0, "the pools were meant to be tight enough to preempt"


def test_policy_depth_and_exact_reservation() -> None:
    """The scheduler sets each round's depth (remaining tokens, contexts) and reserves exactly the nodes of the
    tree cut to that depth; update_from_output moves the counters."""
    from scheduler.spec_policy import SpecPolicy, TreeShape

    policy = SpecPolicy(TreeShape((2, 2, 1)), max_model_len=64, draft_max_len=12)
    assert [policy.num_nodes(d) for d in range(4)] == [0, 2, 6, 10]
    assert policy.depth(num_tokens=5, remaining_tokens=10) == 3
    assert policy.depth(num_tokens=5, remaining_tokens=3) == 2  # one token is the recovered/bonus one
    assert policy.depth(num_tokens=10, remaining_tokens=10) == 2  # candidates stay inside the draft's context
    assert policy.depth(num_tokens=63, remaining_tokens=10) == 0  # the target's context is full
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg, BlockManager(64, 1), BlockManager(64, 1), 10, policy=policy)
    a = make_req(0, 4, max_tokens=4)
    sched.add(a)
    play(sched, sched.schedule())  # prefill: 4 committed, the first token in flight
    assert (a.num_cached_target, a.num_cached_draft, a.num_tokens) == (4, 4, 5)
    batch = sched.schedule()
    assert batch.rounds == [a] and batch.depths == [2]  # 3 tokens left: 2 candidates + 1
    assert len(sched.target_blocks.tables[0]) == 5 + 6  # every token so far + the depth-2 tree's 6 nodes
    sched.update_from_output(batch, [VerifyResult([1], [9, 9], 1, False)], [6], {0: 6})
    assert (a.num_cached_target, a.num_cached_draft) == (6, 6)  # in-flight token + 1 accepted node
    assert len(sched.target_blocks.tables[0]) == 6  # the target's scratch is given back at once
    assert (a.stats.num_rounds, a.stats.num_drafted, a.stats.num_accepted, a.stats.num_bonus) == (1, 6, 1, 0)


def test_held_requests_get_no_round_and_keep_their_kv() -> None:
    # While the draft is replaced the engine holds seeded sampled requests (LLMEngine._needs_draft).
    sched = make_sched(nodes=2, draft=True)
    a, b = make_req(0, 4), make_req(1, 4)
    sched.add(a)
    sched.add(b)
    play(sched, sched.schedule())  # both prefilled
    blocks = list(sched.target_blocks.tables[b.seq_id])
    batch = sched.schedule(held=lambda r: r is b)
    assert batch.rounds == [a] and b.status is RequestStatus.RUNNING
    assert sched.target_blocks.tables[b.seq_id][: len(blocks)] == blocks  # its KV stays
    play(sched, batch)
    # Every running request held, nothing waiting: an empty step, not a preemption or "KV cache too small".
    batch = sched.schedule(held=lambda r: True)
    assert batch.empty and not batch.preempted and sched.running == [a, b]
    assert sched.schedule().rounds == [a, b]  # released: both decode again


def test_the_policy_is_told_when_prompt_chunks_will_share_the_step() -> None:
    """A waiting request with room to admit it (or a running prefill) makes ``prefill`` true for the plan; a
    waiting one with no room, or none at all, leaves it false (the adaptive policy explores only then)."""
    from scheduler.spec_policy import SpecPolicy, TreeShape

    seen: list[bool] = []

    class Recording(SpecPolicy):
        def plan(self, reqs, prefill=False):
            seen.append(prefill)
            return [()] * len(reqs)

    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    sched = Scheduler(cfg, BlockManager(64, 4), BlockManager(64, 4), 0,
                      policy=Recording(TreeShape((1,)), 10_000, 10_000))
    a, b, c = make_req(0, 3), make_req(1, 3), make_req(2, 3)
    sched.add(a)
    play(sched, sched.schedule())  # a is admitted and prefilled (nobody decodes)
    play(sched, sched.schedule())  # a decodes alone
    sched.add(b)
    play(sched, sched.schedule())  # a decodes, b is admitted
    sched.add(c)
    play(sched, sched.schedule())  # a and b decode, c waits for a slot
    assert seen == [True, False, True, False], seen
