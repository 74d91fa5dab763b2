"""Prefix caching in the block accounting, on hand-made requests (pure Python: no model runs).

``play`` (tests/test_scheduler.py) stands in for the workers. The properties: a request admitted after another
with the same prefix starts its prefill at its first uncached block, never past its last prompt token's block;
shared blocks are reference-counted and outlive their requests; cached blocks are evicted, least recently used
first, before anyone is refused or preempted; scratch and partial blocks are never cached; the draft caches
only prompt blocks; a lost worker's pool forgets every hash.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import chain_hashes, hash_block
from scheduler.request import FinishReason, Request
from scheduler.reset import forget_cached, requeue_all
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import play

BS = 4


def req(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Request:
    r = Request(seq_id, str(seq_id), list(prompt), SamplingParams(max_tokens=max_tokens))
    r.stats.arrival_time = float(seq_id)
    return r


def sched(num_blocks: int = 64, draft: bool = False, nodes: int = 0, caching: bool = True,
          budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                     BlockManager(num_blocks, BS, caching, b"target"),
                     BlockManager(num_blocks, BS, caching, b"draft") if draft else None, nodes)


def run(s: Scheduler, max_steps: int = 200, accept: int = 0) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        play(s, s.schedule(), accept)
    raise AssertionError("requests still unfinished")


def first_chunk(s: Scheduler, r: Request) -> tuple[int, int]:
    s.add(r)
    batch = s.schedule()
    (c,) = [c for c in batch.prefills if c.req is r]
    return c.start, c.end


SYSTEM = list(range(10, 30))  # 20 tokens: 5 full blocks


def test_hashes_chain_over_the_prefix() -> None:
    a = chain_hashes(SYSTEM + [1, 2, 3, 4], BS, [], 10)
    b = chain_hashes([99] + SYSTEM[1:] + [1, 2, 3, 4], BS, [], 10)
    assert len(a) == 6  # full blocks only
    assert all(x != y for x, y in zip(a, b, strict=True))  # one token differs in block 0: every later block differs too
    assert chain_hashes(SYSTEM, BS, [], 10) == a[:5]
    assert hash_block(b"", [1, 2, 3, 4]) != hash_block(b"", [1, 2, 3, 4], ("lora", 1))


def test_a_shared_prefix_is_prefilled_once_and_outlives_its_request() -> None:
    s = sched()
    first = req(0, SYSTEM + [1, 2])
    assert first_chunk(s, first) == (0, 22)
    run(s)
    assert s.target_blocks.num_free == s.target_blocks.num_blocks  # cached blocks count as free
    assert s.target_blocks.num_cached == 6  # 5 prompt blocks + the block the outputs filled
    second = req(1, SYSTEM + [5, 6, 7])
    assert first_chunk(s, second) == (20, 23)  # starts at its first uncached block
    assert second.num_cached_target == 20 and second.stats.num_cached_tokens == 20
    assert s.prefix_stats.hits == 20 and s.prefix_stats.queries == 22 + 23
    run(s)


def test_sharing_is_reference_counted_while_both_run() -> None:
    s = sched()
    a = req(0, SYSTEM + [1], max_tokens=12)
    s.add(a)
    play(s, s.schedule())  # a's prompt is committed; its blocks are offered at the next schedule
    b = req(1, SYSTEM + [2], max_tokens=12)
    s.add(b)
    play(s, s.schedule())
    shared = s.target_blocks.tables[0][:5]
    assert s.target_blocks.tables[1][:5] == shared and b.num_cached_target >= 20
    s.finish(a, FinishReason.ABORT)
    assert s.target_blocks.tables[1][:5] == shared  # still b's
    assert s.target_blocks.num_free == s.target_blocks.num_blocks - len(s.target_blocks.tables[1])
    run(s)


def test_the_last_prompt_token_is_always_computed() -> None:
    s = sched()
    run_one = req(0, SYSTEM)  # exactly 5 blocks
    s.add(run_one)
    run(s)
    again = req(1, SYSTEM)
    # Its whole prompt is cached, but the target must compute the last token's logits: the block holding it is
    # recomputed into a fresh block (a shared block is never written).
    assert first_chunk(s, again) == (16, 20)
    run(s)


def test_caching_off_recomputes_everything() -> None:
    s = sched(caching=False)
    s.add(req(0, SYSTEM + [1]))
    run(s)
    assert first_chunk(s, req(1, SYSTEM + [1])) == (0, 21)
    assert s.target_blocks.num_cached == 0 and s.prefix_stats.queries == 0


def test_cached_blocks_are_evicted_lru_before_a_request_waits() -> None:
    s = sched(num_blocks=12)
    for i, base in enumerate((100, 200)):
        s.add(req(i, list(range(base, base + 16)) + [1], max_tokens=2))
        run(s)
    assert s.target_blocks.num_cached == 8 and s.target_blocks.num_free == 12
    # A request needing 10 blocks: without eviction it could never run. It runs at once, and the blocks it
    # takes are the least recently used: the first request's (its tail before its head).
    big = req(2, list(range(300, 338)), max_tokens=2)
    s.add(big)
    batch = s.schedule()
    assert [c.req for c in batch.prefills] == [big] and not batch.preempted
    still = s.target_blocks.match(chain_hashes(list(range(200, 216)), BS, [], 4))
    assert still >= 1  # the second request's head survived; the first one's prefix is gone
    assert s.target_blocks.match(chain_hashes(list(range(100, 116)), BS, [], 4)) == 0
    run(s)


def test_scratch_and_partial_blocks_are_never_cached() -> None:
    s = sched(nodes=6)
    r = req(0, SYSTEM + [1, 2], max_tokens=20)
    s.add(r)
    play(s, s.schedule())
    s.schedule()  # a round: its table covers the committed tokens and 6 scratch nodes
    table = s.target_blocks.tables[0]
    assert len(table) * BS >= r.num_tokens + 6
    # Only committed full blocks answer a lookup: a prompt equal to the committed tokens plus the scratch
    # positions' worth of tokens hits only the committed full blocks.
    probe = chain_hashes(r.all_token_ids + [0] * 12, BS, [], 10)
    assert s.target_blocks.match(probe) == r.num_cached_target // BS == 5


def test_the_draft_caches_prompt_blocks_and_the_hit_is_the_draft_s_own() -> None:
    s = sched(draft=True, nodes=2)
    a = req(0, SYSTEM + [1, 2], max_tokens=12)
    s.add(a)
    run(s, accept=2)
    tokens = a.all_token_ids
    hashes = chain_hashes(tokens, BS, [], 100)
    assert s.target_blocks.match(hashes) == len(tokens) // BS  # the target caches its outputs' blocks too
    assert s.draft_blocks.match(hashes) == 5  # the draft only the prompt's
    b = req(1, tokens + [3])  # an agent resending the conversation
    s.add(b)
    batch = s.schedule()
    assert b.num_cached_target == (len(tokens) // BS) * BS and b.num_cached_draft == 20
    assert s.prefix_stats.draft_hits == 20 and s.prefix_stats.hits == b.num_cached_target
    assert [(c.start, c.end) for c in batch.prefills] == [(b.num_cached_target, len(tokens) + 1)]
    run(s, accept=2)


def test_a_preempted_request_finds_its_own_blocks_again() -> None:
    s = sched(num_blocks=18, budget=64)
    old = req(0, SYSTEM + [1], max_tokens=30)
    s.add(old)
    play(s, s.schedule())
    new = req(1, list(range(200, 230)), max_tokens=30)
    s.add(new)
    preempted = []
    for _ in range(200):
        if not s.has_unfinished:
            break
        batch = s.schedule()
        preempted += batch.preempted
        play(s, batch)
    assert new in preempted
    assert new.stats.num_cached_tokens > 0  # re-admitted on its own cached blocks


def test_a_lost_pool_forgets_its_hashes() -> None:
    s = sched(draft=True)
    a = req(0, SYSTEM + [1], max_tokens=12)
    s.add(a)
    play(s, s.schedule())
    s.schedule()
    hashes = chain_hashes(SYSTEM, BS, [], 5)
    assert s.target_blocks.match(hashes) == 5 and s.draft_blocks.match(hashes) == 5
    forget_cached(s, target=False)
    assert s.draft_blocks.match(hashes) == 0 and s.target_blocks.match(hashes) == 5
    s.schedule()  # the blocks the running request holds are not offered again: they came from the lost cache
    assert s.draft_blocks.match(hashes) == 0
    requeue_all(s)
    forget_cached(s, target=True)
    assert s.target_blocks.match(hashes) == 0
    assert s.target_blocks.num_free == s.target_blocks.num_blocks
    s.add(req(1, SYSTEM + [1]))
    batch = s.schedule()
    assert len(batch.prefills) == 2 and all(c.start == 0 for c in batch.prefills)  # both recompute from 0
