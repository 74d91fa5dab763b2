"""The asynchronous front end: an engine loop thread that owns the engine, fed by a queue.

```
asyncio side (routes)                         engine loop thread (owns the LLMEngine)
  add_request ──(ADD, id, prompt, params)──▶   inbox ─▶ engine.add_request / abort_request
  abort       ──(ABORT, id)───────────────▶          ─▶ engine.step() ─▶ deltas
  RequestStream ◀── per-request asyncio.Queue ◀── call_soon_threadsafe(one batch per step)
```

Nothing but the loop thread touches the engine; the front end only enqueues commands and reads deltas (and,
for ``/health``, a snapshot of the roles the engine's recovery is restoring: ``Recovery.restoring``). The loop
blocks on its inbox when the engine is idle (no polling) and steps while anything is unfinished. Each request
first gets an acknowledgement (or the engine's ValueError, so a route can still answer 400 before it starts a
stream), then its deltas. A stream left early (client gone) aborts its request; the engine frees its KV at the
next step.

Faults, in the order the server meets them:

- A worker restart inside the engine (engine/execution/recovery.py: a dead target rank is rebuilt and its requests
  re-prefilled; a dead draft is replaced while decoding goes on without speculation): the loop keeps stepping,
  streams pause then continue, and ``health()`` says "degraded" with the role being restored.
- The engine itself fails (a step raises: ``TooManyRestartsError``, ``EngineDeadError``, any other exception):
  given an ``engine_factory``, the loop shuts the engine down and builds a new one (at most
  ``max_engine_restarts`` within ``engine_restart_window_s``, with a backoff doubling from
  ``restart_backoff_s``), then re-admits every open request from its tokens so far (prompt + what its stream
  already got, the rest of max_tokens), so streams continue without repeating text. ``health()`` is "restarting"
  (HTTP 503) meanwhile and new requests get 503. Past the budget, or without a factory, every open stream gets
  ``EngineUnavailableError`` and the engine stays down (503, with the reason); the server itself stays up.

The waiting queue is bounded: ``max_queue`` requests may wait for a running slot; beyond that ``add_request``
raises ``QueueFullError`` (HTTP 429 with Retry-After) instead of letting memory climb. A request waits only
while no running slot is free: one on its way to an engine with free slots (``max_num_seqs`` minus those
running) is not counted against the queue, so a burst into an idle server is admitted whole.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.server.health import Health, RestartBudget, read_restoring
from engine.server.metrics import EngineStats, ServerMetrics, read_engine_stats
from engine.server.open_requests import OpenRequests
from engine.server.streams import (
    ACCEPTED,
    STOP,
    AbortCommand,
    AddCommand,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
)

logger = logging.getLogger("specserve.server")


def read_max_num_seqs(engine: Any) -> int:
    """The engine's running slots (``--max-num-seqs``)."""
    n = getattr(engine, "max_num_seqs", None)
    return int(n) if n is not None else int(engine.config.scheduler.max_num_seqs)


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue: int = 256, retry_after_s: float = 1.0,
                 metrics: ServerMetrics | None = None,
                 stats_reader: Callable[[Any], EngineStats] = read_engine_stats,
                 engine_factory: Callable[[], Any] | None = None, max_engine_restarts: int = 3,
                 engine_restart_window_s: float = 600.0, restart_backoff_s: float = 1.0,
                 on_new_engine: Callable[[Any], None] | None = None,
                 restoring_reader: Callable[[Any], tuple[str, ...]] = read_restoring) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self._engine = engine  # swapped by the loop thread when it restarts the engine
        self._factory = engine_factory
        self._budget = RestartBudget(max_engine_restarts, engine_restart_window_s, restart_backoff_s)
        self._on_new_engine = on_new_engine
        self._read_restoring = restoring_reader
        self.engine_restarts = 0  # engines built after a failure (for tests and logs)
        self._restarting: str | None = None  # why the engine is being rebuilt now (None: it is not)
        self._engine_down = False  # the current engine has been shut down
        self.max_model_len: int = engine.max_model_len  # fixed at construction: safe to read from any thread
        self.max_num_seqs: int = read_max_num_seqs(engine)
        self.vocab_size: int | None = getattr(engine, "vocab_size", None)  # bounds top_k in the front end's 400s
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self._read_stats = stats_reader
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()  # set on shutdown: a restart's backoff sleep ends early
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Front-end state (event-loop thread only).
        self._streams: dict[str, RequestStream] = {}
        # Written by the loop thread, read by the front end (a reference swap: atomic under the GIL).
        self._stats = EngineStats()
        self._dead: BaseException | None = None
        self._stopped = False
        if metrics is not None:
            metrics.track_waiting(lambda: self.num_waiting)

    # ---------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will read the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stats = self._read_stats(self._engine)
        self._thread = threading.Thread(target=self._run, name="specserve-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the loop (it shuts the engine down: Ray actors, sockets) and wait for it."""
        self._stopped = True
        if self._thread is None:
            return
        self._inbox.put(STOP)
        self._wake.set()  # a restart's backoff ends now
        await asyncio.to_thread(self._thread.join, timeout_s)
        self._fail_all(EngineUnavailableError("the server is shutting down"))

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._dead is None and not self._stopped
                and self._restarting is None)

    def health(self) -> Health:
        """For ``/health``, from any thread: the engine restarting or down (503), degraded, or ok."""
        if not self.is_ready:
            status = "restarting" if self._restarting is not None and not self._stopped else "down"
            return Health(status, self._unavailable_reason())
        try:
            restoring = self._read_restoring(self._engine)
        except Exception:  # a read racing the loop thread: report what is sure
            logger.exception("reading the engine's recovery state failed")
            restoring = ()
        if restoring:
            return Health("degraded", f"restoring the {' and '.join(restoring)} worker"
                                      f"{'s' if len(restoring) > 1 else ''}; requests are served meanwhile",
                          restoring)
        return Health("ok")

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def num_running(self) -> int:
        return self._stats.num_running

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Accepted requests that wait for a running slot: queued in the engine, plus those on their way to it
        beyond the slots still free (none are free while the engine has a queue of its own)."""
        s = self._stats
        in_transit = max(0, len(self._streams) - s.num_running - s.num_waiting)
        free = max(0, self.max_num_seqs - s.num_running) if s.num_waiting == 0 else 0
        return s.num_waiting + max(0, in_transit - free)

    @property
    def capacity(self) -> int:
        """The most requests the server can ever hold at once: running slots plus the waiting queue."""
        return self.max_num_seqs + self.max_queue

    @property
    def stats(self) -> EngineStats:
        return self._stats

    # -------------------------------------------------------------------------------------- the front end
    async def add_request(self, request_id: str, prompt: str | list[int], params: Any,
                          arrival: float | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises QueueFullError (too many waiting), ValueError (the engine refused it: names the field and the
        limit), EngineUnavailableError (the engine is not running). Cancelling this call aborts the request.
        """
        if not self.is_ready:
            raise EngineUnavailableError(self._unavailable_reason())
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        waiting = self.num_waiting
        if waiting >= self.max_queue:
            raise QueueFullError(waiting, self.max_queue, self.retry_after_s)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._inbox.put(AddCommand(request_id, prompt, params, time.monotonic() if arrival is None else arrival,
                             priority))
        try:
            ack = await stream.queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(ack, BaseException):
            raise ack
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: Any) -> AsyncIterator[Any]:
        """The request's deltas; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream is dropped now, the engine frees its KV at the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            self._inbox.put(AbortCommand(request_id))

    def _dispatch(self, items: list[tuple[str, Any]]) -> None:
        """On the event loop: hand each item to its stream (an aborted request's late deltas are dropped)."""
        for rid, item in items:
            if rid is None:  # the engine died: every stream ends with the error
                self._fail_all(item)
                continue
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if item is ACCEPTED:
                stream.queue.put_nowait(item)
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._streams[rid]
            stream.queue.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.queue.put_nowait(error)

    def _unavailable_reason(self) -> str:
        if self._stopped:
            return "the server is shutting down"
        if self._dead is not None:
            why = f"the engine stopped after a failed step ({type(self._dead).__name__}: {self._dead})"
            if self._factory is not None:
                why += f"; {self._budget.describe()}"
            return why
        if self._restarting is not None:
            return f"the engine is restarting after a failed step ({self._restarting}); retry shortly"
        return "the engine is not running"

    # ------------------------------------------------------------------------------- the engine loop thread
    def _post(self, items: list[tuple[str | None, Any]]) -> None:
        if not items:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        requests = OpenRequests(self.metrics)
        try:
            while True:
                try:
                    self._serve(requests)
                    return  # stopped
                except BaseException as e:  # a failed step: the engine's state can no longer be trusted
                    logger.exception("engine step failed")
                    if not self._restart(e, requests):
                        self._dead = self._dead or e
                        self._post([(None, EngineUnavailableError(self._unavailable_reason()))])
                        return
        finally:
            self._restarting = None
            self._shutdown_engine()

    def _serve(self, requests: OpenRequests) -> None:
        """Step the current engine until told to stop (returns) or a step fails (raises)."""
        engine = self._engine
        while True:
            # Block only when there is nothing to step; otherwise take whatever arrived since the last step.
            cmds = [self._inbox.get()] if not engine.has_unfinished else []
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if any(c is STOP for c in cmds):
                return
            out = [requests.apply(engine, c) for c in cmds]
            if engine.has_unfinished:
                try:
                    deltas = engine.step()
                except BaseException:
                    # The acknowledgements go out all the same: those requests are open and will be re-admitted
                    # (a lost one would leave its stream taking its first delta for the acknowledgement).
                    self._post([o for o in out if o is not None])
                    raise
                now = time.monotonic()
                out += [(d.request_id, d) for d in deltas if requests.observe(d, now)]
            self._stats = self._read_stats(engine)  # before the deltas reach the front end (queue bound)
            if self.metrics is not None:
                self.metrics.observe_stats(self._stats)
            self._post([o for o in out if o is not None])

    def _shutdown_engine(self) -> None:
        """Shut the current engine down once (Ray actors, sockets)."""
        if self._engine_down:
            return
        self._engine_down = True
        try:
            self._engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    def _restart(self, err: BaseException, requests: OpenRequests) -> bool:
        """Replace a failed engine and re-admit the open requests; False when that is not allowed or failed
        ``max_engine_restarts`` times within the window (the caller then fails every stream)."""
        if self._factory is None or self._stopped or isinstance(err, (KeyboardInterrupt, SystemExit)):
            return False
        self._restarting = f"{type(err).__name__}: {err}"
        self._shutdown_engine()
        failures = [self._restarting]
        while True:
            delay = self._budget.take()  # the first at once, then a doubling backoff: no tight restart loop
            if delay is None:
                logger.error("engine restart budget spent: %s", self._budget.describe())
                # Set before ``_restarting`` clears: never a moment that looks ready.
                self._dead = err if len(failures) == 1 else RuntimeError("; ".join(failures))
                self._restarting = None
                return False
            if self._wake.wait(delay) or self._stopped:
                self._dead = err
                return False
            try:
                engine = self._factory()
            except Exception as e:  # could not even build one (workers do not start): count it, back off
                logger.exception("building a new engine failed")
                failures.append(f"{type(e).__name__}: {e}")
                self._restarting = "; ".join(failures)
                continue
            break
        self._engine, self._engine_down = engine, False
        self.engine_restarts += 1
        if self.metrics is not None:
            self.metrics.engine_replaced()
        if self._on_new_engine is not None:
            self._on_new_engine(engine)
        self._post(requests.readmit(engine))
        self._stats = self._read_stats(engine)
        self._restarting = None
        logger.warning("engine restarted after a failed step; %d open request(s) re-admitted", len(requests))
        return True
