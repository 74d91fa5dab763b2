"""The asynchronous front end: an engine loop thread that owns the engine, fed by a queue.

```
asyncio side (routes)                         engine loop thread (owns the LLMEngine)
  add_request ──(ADD, id, prompt, params)──▶   inbox ─▶ engine.add_request / abort_request
  abort       ──(ABORT, id)───────────────▶          ─▶ engine.step() ─▶ deltas
  RequestStream ◀── per-request asyncio.Queue ◀── call_soon_threadsafe(one batch per step)
```

Nothing but the loop thread touches the engine; the front end only enqueues commands and reads deltas. The loop
blocks on its inbox when the engine is idle (no polling) and steps while anything is unfinished. Each request
first gets an acknowledgement (or the engine's ValueError, so a route can still answer 400 before it starts a
stream), then its deltas. A stream left early (client gone) aborts its request; the engine frees its KV at the
next step. If a step fails, every open stream gets ``EngineUnavailableError`` and the engine stays down
(``/health`` answers 503).

The waiting queue is bounded: ``max_queue`` requests may wait for a running slot; beyond that ``add_request``
raises ``QueueFullError`` (HTTP 429 with Retry-After) instead of letting memory climb.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.server.metrics import EngineStats, ServerMetrics, read_engine_stats

logger = logging.getLogger("specserve.server")


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry after ``retry_after_s``."""

    def __init__(self, waiting: int, max_queue: int, retry_after_s: float) -> None:
        super().__init__(f"server overloaded: {waiting} requests waiting (max_queue={max_queue}); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine loop is not running (stopped, or a step failed)."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: Any  # SamplingParams
    arrival: float  # time.monotonic() at the front end
    priority: int = 0  # lower is admitted first: batch jobs (engine/batch_runner.py) use 1


@dataclass
class _Abort:
    request_id: str


_STOP = object()
_ACCEPTED = object()  # first item of every stream: the engine took the request


@dataclass
class _Timing:
    """Per-request times kept on the loop thread for the latency histograms."""

    arrival: float
    first: float | None = None
    last: float | None = None


class RequestStream:
    """The deltas of one request, in order; ends after the delta with ``finished=True``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()  # bounded by the request's own max_tokens
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue: int = 256, retry_after_s: float = 1.0,
                 metrics: ServerMetrics | None = None,
                 stats_reader: Callable[[Any], EngineStats] = read_engine_stats) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self._engine = engine
        self.max_model_len: int = engine.max_model_len  # fixed at construction: safe to read from any thread
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self._read_stats = stats_reader
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
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
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout_s)
        self._fail_all(EngineUnavailableError("the server is shutting down"))

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None and not self._stopped

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
        """Accepted, not finished and not in the running batch (queued in the engine or on the way there)."""
        return max(0, len(self._streams) - self._stats.num_running)

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
        self._inbox.put(_Add(request_id, prompt, params, time.monotonic() if arrival is None else arrival,
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
            self._inbox.put(_Abort(request_id))

    def _dispatch(self, items: list[tuple[str, Any]]) -> None:
        """On the event loop: hand each item to its stream (an aborted request's late deltas are dropped)."""
        for rid, item in items:
            if rid is None:  # the engine died: every stream ends with the error
                self._fail_all(item)
                continue
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if item is _ACCEPTED:
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
        if self._dead is not None:
            return f"the engine stopped after a failed step ({type(self._dead).__name__}: {self._dead})"
        if self._stopped:
            return "the server is shutting down"
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
        engine = self._engine
        timings: dict[str, _Timing] = {}
        try:
            while True:
                # Block only when there is nothing to step; otherwise take whatever arrived since the last step.
                cmds = [self._inbox.get()] if not engine.has_unfinished else []
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    return
                out = [self._apply(engine, c, timings) for c in cmds]
                if engine.has_unfinished:
                    deltas = engine.step()
                    now = time.monotonic()
                    out += [(d.request_id, d) for d in deltas if self._observe(d, timings, now)]
                self._stats = self._read_stats(engine)  # before the deltas reach the front end (queue bound)
                if self.metrics is not None:
                    self.metrics.observe_stats(self._stats)
                self._post([o for o in out if o is not None])
        except BaseException as e:  # a failed step: worker state can no longer be trusted
            logger.exception("engine loop stopped")
            self._dead = e
            self._post([(None, EngineUnavailableError(self._unavailable_reason()))])
        finally:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _apply(self, engine: Any, cmd: Any, timings: dict[str, _Timing]) -> tuple[str, Any] | None:
        if isinstance(cmd, _Abort):
            timing = timings.pop(cmd.request_id, None)
            if engine.abort_request(cmd.request_id) and timing is not None and self.metrics is not None:
                self.metrics.observe_finished("abort", time.monotonic() - timing.arrival, None, 0)
            return None
        try:
            # priority only when set: an engine without priorities (a test double) still serves online traffic
            extra = {"priority": cmd.priority} if cmd.priority else {}
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params, **extra)
        except Exception as e:  # ValueError: refused (a 400); anything else fails this request alone
            if not isinstance(e, ValueError):
                logger.exception("add_request failed for %s", cmd.request_id)
            return cmd.request_id, e
        timings[cmd.request_id] = _Timing(cmd.arrival)
        return cmd.request_id, _ACCEPTED

    def _observe(self, d: Any, timings: dict[str, _Timing], now: float) -> bool:
        """Latency metrics of one delta; False for a request that was aborted (nobody reads it)."""
        t = timings.get(d.request_id)
        if t is None:
            return False
        m = self.metrics
        if d.new_token_ids and t.first is None:
            t.first = now
            if m is not None:
                m.observe_first_output(now - t.arrival, d.num_prompt_tokens)
        if m is not None:
            m.observe_output(len(d.new_token_ids), None if t.last is None or not d.new_token_ids else now - t.last)
        if d.new_token_ids:
            t.last = now
        if d.finished:
            del timings[d.request_id]
            if m is not None:
                m.observe_finished(d.finish_reason or "stop", now - t.arrival,
                                   None if t.first is None else t.first - t.arrival, d.num_output_tokens)
        return True
