"""Start the bookkeeping over after a worker group lost its cache (engine/execution/recovery.py).

Nothing the scheduler believed about a lost cache is kept; the counters are derived from the requests again.

- The target's cache is gone: every running request goes back to the head of the waiting queue with no
  committed KV (as after a preemption) and every block is given back; each request keeps its tokens, so
  prompt + output so far are re-prefilled, the last output token pending as after any round
  (``Request.prefill_end``).
- The draft's cache is gone: the block tables stay (reserved for the next rounds); once a new draft has been
  refilled with every running request's target-committed tokens, that is what the draft has committed.
- Either way the lost pool's prefix cache is forgotten (``forget_cached``): a hash names K/V the new worker
  does not have. The draft's is forgotten again when the new draft is refilled: blocks offered while it was
  down (the scheduler counts prompt chunks as the draft's even then) hold nothing.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler


def requeue_all(scheduler: Scheduler) -> list[Request]:
    """Every running request back to waiting, in arrival order ahead of the ones that never ran; pools empty."""
    requeued = sorted(scheduler.running, key=lambda r: (r.stats.arrival_time, r.seq_id))
    for req in requeued:
        req.num_cached_target = 0
        req.num_cached_draft = 0
        req.status = RequestStatus.WAITING
    scheduler.running.clear()
    scheduler.waiting.extendleft(reversed(requeued))
    # In place: others hold these pools' tables (the drafter reads the draft's).
    _empty(scheduler.target_blocks)
    if scheduler.draft_blocks is not None:
        _empty(scheduler.draft_blocks)
    return requeued


def forget_cached(scheduler: Scheduler | None, target: bool) -> None:
    """The target's (``target``) or the draft's worker lost its cache: no cached block of that pool is valid."""
    if scheduler is None:
        return
    pool = scheduler.target_blocks if target else scheduler.draft_blocks
    if pool is not None:
        pool.drop_cache()


def draft_refilled(scheduler: Scheduler) -> None:
    """A new draft holds every running request's target-committed tokens, and nothing more."""
    for req in scheduler.running:
        req.num_cached_draft = req.num_cached_target


def _empty(pool: BlockManager) -> None:
    for seq_id in list(pool.tables):
        pool.free(seq_id)
    if pool.num_free != pool.num_blocks:
        raise RuntimeError(f"KV block accounting is off: {pool.num_blocks - pool.num_free} blocks held by no "
                           "request after every request gave its blocks back")
