"""Runs the store's batches (engine/jobs/store.py) on the server's event loop: validate, feed, commit, finalize.

```
store (SQLite) ──pending rows──▶ runner ──execute(endpoint, body)──▶ executor (the online code path, priority 1)
      ▲                                                                  │
      └──── record(idx, row): committed before the request counts ◀──────┘
```

At most ``max_in_flight`` batch requests are in the engine at once, so a job of 10^6 lines costs the memory of
a few dozen requests, and the engine's waiting queue stays short for online traffic (which also outranks batch
work in the scheduler). On start the runner picks up whatever the store says is unfinished: a batch cut short
in ``validating`` is validated again, ``in_progress`` runs its pending rows, ``finalizing`` / ``cancelling``
finish. A request cut short by a crash was never recorded, so it is pending and runs again; a recorded one
never runs again (``JobStore.record`` ignores a second result), so the output holds each request exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.jobs.lines import at_line, error_row, response_row
from engine.jobs.store import JobStore, PendingRequest

logger = logging.getLogger("specserve.batch")

BATCH_PRIORITY = 1  # online requests run at 0: the scheduler admits them first


class RetryLater(Exception):
    """The engine cannot take the request now (queue full, engine restarting): run it again later."""


class BatchExecutor(Protocol):
    def execute(self, endpoint: str, body: dict[str, Any], request_id: str) -> Awaitable[tuple[int, dict]]:
        """Answer the request as the online route would: (HTTP status, response body); raise RetryLater when
        it should be tried again later rather than counted as failed."""


@dataclass
class _InFlight:
    batch_id: str
    idx: int
    task: asyncio.Task


class BatchRunner:
    def __init__(self, store: JobStore, executor: BatchExecutor, *, max_in_flight: int = 32,
                 poll_s: float = 1.0, retry_s: float = 1.0) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.store = store
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.poll_s = poll_s
        self.retry_s = retry_s
        self._inflight: dict[tuple[str, int], _InFlight] = {}
        self._cursor: dict[str, int] = {}  # batch -> last index handed out (rows after it are read next)
        self._results: asyncio.Queue[tuple[str, int, bool, dict]] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._backoff_until = 0.0

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start on the running event loop; resumes whatever the store left unfinished."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._main(), name="batch-runner"),
                           asyncio.create_task(self._committer(), name="batch-committer")]

    async def stop(self) -> None:
        """Stop feeding; requests in flight are cancelled and stay pending in the store (they run on restart)."""
        for f in list(self._inflight.values()):
            f.task.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*(f.task for f in self._inflight.values()), *self._tasks, return_exceptions=True)
        self._tasks = []

    def wake(self) -> None:
        """Look at the store now (a batch was created or cancelled)."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # ---------------------------------------------------------------------------------------- the main loop
    async def _main(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the store failed (disk full?): log, and try again after a pause
                logger.exception("batch runner step failed")
                await asyncio.sleep(self.poll_s)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def _tick(self) -> None:
        store = self.store
        for batch_id in store.batches_in("validating"):
            await asyncio.to_thread(store.validate, batch_id)
        now = time.time()
        for batch_id in store.batches_in("cancelling"):
            if self._cancel_inflight(batch_id):
                await self._drain_results()
                await asyncio.to_thread(store.finalize, batch_id, "cancelled")
        for batch_id in store.batches_in("finalizing"):
            await asyncio.to_thread(store.finalize, batch_id, "completed")
        for batch_id in store.batches_in("in_progress"):
            b = store.get_batch(batch_id)
            if b["expires_at"] is not None and now > b["expires_at"]:
                if self._cancel_inflight(batch_id):
                    await self._drain_results()
                    await asyncio.to_thread(store.finalize, batch_id, "expired")
                continue
            if time.monotonic() >= self._backoff_until:
                self._feed(batch_id)
            if not self._has_inflight(batch_id) and self._results.empty() and store.num_pending(batch_id) == 0:
                await asyncio.to_thread(store.finalize, batch_id, "completed")
                self._cursor.pop(batch_id, None)

    def _feed(self, batch_id: str) -> None:
        room = self.max_in_flight - len(self._inflight)
        while room > 0:
            fetched = self.store.pending(batch_id, self._cursor.get(batch_id, -1), room)
            if not fetched:
                return
            self._cursor[batch_id] = fetched[-1].idx
            for r in fetched:
                if (batch_id, r.idx) not in self._inflight:  # after a retry the scan starts over
                    task = asyncio.create_task(self._run_one(r))
                    self._inflight[(batch_id, r.idx)] = _InFlight(batch_id, r.idx, task)
                    room -= 1

    async def _run_one(self, r: PendingRequest) -> None:
        key = (r.batch_id, r.idx)
        try:
            batch = self.store.get_batch(r.batch_id)
            status, body = await self.executor.execute(batch["endpoint"], r.body, f"{r.batch_id}-{r.idx}")
            row = response_row(r.custom_id, status, body if status == 200 else at_line(body, r.line))
            await self._results.put((r.batch_id, r.idx, status == 200, row))
        except RetryLater:
            # Left pending: read again from the start of the batch after a pause.
            self._inflight.pop(key, None)
            self._cursor[r.batch_id] = -1
            self._backoff_until = time.monotonic() + self.retry_s
        except asyncio.CancelledError:
            self._inflight.pop(key, None)  # pending in the store: runs again after a restart or a retry
            raise
        except Exception as e:  # the request itself broke something: it fails alone
            logger.exception("batch request %s line %d failed", r.batch_id, r.idx)
            await self._results.put((r.batch_id, r.idx, False,
                                     error_row(r.custom_id, "server_error", f"{type(e).__name__}: {e}")))
        finally:
            self._wake.set()

    async def _committer(self) -> None:
        """Commit results in groups (one transaction per group); a request leaves the in-flight set only when
        its row is committed, so 'done' always means 'on disk'."""
        while True:
            first = await self._results.get()
            group = [first]
            while not self._results.empty():
                group.append(self._results.get_nowait())
            by_batch: dict[str, list] = {}
            for batch_id, idx, ok, row in group:
                by_batch.setdefault(batch_id, []).append((idx, ok, row))
            for batch_id, rows in by_batch.items():
                await asyncio.to_thread(self.store.record, batch_id, rows)
                for idx, _, _ in rows:
                    self._inflight.pop((batch_id, idx), None)
            for _ in group:
                self._results.task_done()
            self._wake.set()

    async def _drain_results(self) -> None:
        await self._results.join()

    def _has_inflight(self, batch_id: str) -> bool:
        return any(k[0] == batch_id for k in self._inflight)

    def _cancel_inflight(self, batch_id: str) -> bool:
        """Cancel the batch's requests in flight; True once none is left (finished ones stay committed)."""
        for key, f in list(self._inflight.items()):
            if key[0] == batch_id and not f.task.done():
                f.task.cancel()
        return not any(k[0] == batch_id and not f.task.done() for k, f in self._inflight.items())
