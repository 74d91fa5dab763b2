"""Start the bookkeeping over after the workers lost their caches (a restarted worker group).

Nothing the scheduler believed about the caches is kept: every running request goes back to the head of the
waiting queue with no committed KV (as after a preemption), and the block pools are rebuilt empty, so the
counters are derived from the requests again. Each request keeps its tokens: prompt + output so far are
re-prefilled, and the last output token is pending as after any round (``Request.prefill_end``).
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler


def requeue_all(scheduler: Scheduler) -> list[Request]:
    """Every running request back to waiting, in arrival order ahead of the ones that never ran; fresh pools."""
    requeued = sorted(scheduler.running, key=lambda r: (r.stats.arrival_time, r.seq_id))
    for req in requeued:
        req.num_cached_target = 0
        req.num_cached_draft = 0
        req.status = RequestStatus.WAITING
    scheduler.running.clear()
    scheduler.waiting.extendleft(reversed(requeued))
    scheduler.target_blocks = _fresh(scheduler.target_blocks)
    if scheduler.draft_blocks is not None:
        scheduler.draft_blocks = _fresh(scheduler.draft_blocks)
    return requeued


def forget_draft_cache(scheduler: Scheduler) -> None:
    """The draft lost its cache: no request has draft KV. Block tables stay (they are reserved for the next
    rounds and the draft will be refilled into them); only the counters start over."""
    for req in scheduler.running:
        req.num_cached_draft = 0


def _fresh(pool: BlockManager) -> BlockManager:
    return BlockManager(pool.num_blocks, pool.block_size)
