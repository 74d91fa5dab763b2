"""``RoutedEngine``: the ingress's stand-in for ``AsyncEngine``, streaming each request from an engine replica.

The server's routes (``Serving``, the Batch API) talk to it exactly as to the one-engine server's ``AsyncEngine``:
``add_request`` returns a ``RequestStream`` once a replica has accepted the request, ``abort`` drops it. Which
replica takes a request is the Serve request router's choice (router.py). One pump task per request reads the
replica's stream into the ``RequestStream``; if the replica fails mid-way (killed, its node lost), the pump sends
the request again with the tokens streamed so far, and whichever replica takes it resumes after them: the client
sees one uninterrupted stream, and a greedy output is the one it would have been.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from engine.serve_replicas.replica_metrics import ReplicaMetrics, sum_stats
from engine.serve_replicas.wire import Accepted, ReplicaError, ReplicaRequest, ReplicaStats
from engine.server.health import Health
from engine.server.metrics import EngineStats, ServerMetrics
from engine.server.streams import EngineUnavailableError, QueueFullError, RequestStream

logger = logging.getLogger("specserve.replicas")


class ReplicaFailed(RuntimeError):
    """A replica's stream broke off (the replica died or could not be reached)."""


def _refusal(err: ReplicaError) -> Exception:
    if err.kind == "invalid":
        return ValueError(err.message)
    if err.kind == "overloaded":
        e = QueueFullError(0, 0, err.retry_after_s)
        e.args = (err.message,)
        return e
    return EngineUnavailableError(err.message)


class RoutedEngine:
    def __init__(self, handle: Any, info: dict[str, Any], *, max_in_flight: int, max_retries: int = 3,
                 retry_backoff_s: float = 0.2, metrics: ServerMetrics | None = None) -> None:
        self._handle = handle.options(stream=True)
        self.max_model_len: int = info["max_model_len"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.vocab_size: int | None = info["vocab_size"]
        self.max_queue = max(0, max_in_flight - self.max_num_seqs)  # so that capacity == max_in_flight
        self.max_in_flight = max_in_flight
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.metrics = metrics
        self.replica_metrics = ReplicaMetrics(metrics.model_name, metrics.registry) if metrics is not None else None
        self._pumps: dict[str, asyncio.Task] = {}
        self._replica_stats: dict[str, EngineStats] = {}  # each replica's latest snapshot
        self._stopped = False
        self.started = False
        if metrics is not None:
            metrics.track_waiting(lambda: max(0, len(self._pumps) - self.max_num_seqs))

    @property
    def capacity(self) -> int:
        return self.max_in_flight

    def start(self) -> None:
        self.started = True

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        self._stopped = True
        for t in list(self._pumps.values()):
            t.cancel()

    def health(self) -> Health:
        if self._stopped:
            return Health("down", "the server is shutting down")
        return Health("ok")

    async def add_request(self, request_id: str, prompt: list[int], params: Any, arrival: float | None = None,
                          priority: int = 0) -> RequestStream:
        if self._stopped:
            raise EngineUnavailableError("the server is shutting down")
        if request_id in self._pumps:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self._pumps) >= self.max_in_flight:
            raise QueueFullError(len(self._pumps), self.max_in_flight, 1.0)
        stream = RequestStream(request_id)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        req = ReplicaRequest(request_id, list(prompt), params, priority)
        task = asyncio.create_task(self._pump(req, stream, accepted, time.monotonic() if arrival is None else arrival))
        self._pumps[request_id] = task
        task.add_done_callback(lambda _: self._pumps.pop(request_id, None))
        try:
            await accepted
        except asyncio.CancelledError:
            task.cancel()
            raise
        return stream

    def _observe_stats(self, item: ReplicaStats) -> None:
        self._replica_stats[item.replica] = item.stats
        if self.replica_metrics is not None:
            self.replica_metrics.engine_stats(item.replica, item.stats)
        if self.metrics is not None:  # the server's usual names, over all replicas
            self.metrics.observe_stats(sum_stats(list(self._replica_stats.values())))

    def abort(self, request_id: str) -> None:
        task = self._pumps.pop(request_id, None)
        if task is not None:
            task.cancel()  # cancelling the replica stream aborts the request there

    async def _pump(self, req: ReplicaRequest, stream: RequestStream, accepted: asyncio.Future,
                    arrival: float) -> None:
        m, rm = self.metrics, self.replica_metrics
        first: float | None = None
        last: float | None = None
        failures = 0
        while True:
            replica, lost = None, False
            try:
                async for item in self._handle.generate.remote(req):
                    if isinstance(item, Accepted):
                        replica = item.replica
                        if rm is not None:
                            rm.accepted(replica)
                        if not accepted.done():
                            accepted.set_result(None)
                        continue
                    if isinstance(item, ReplicaStats):
                        self._observe_stats(item)
                        continue
                    if isinstance(item, ReplicaError) and item.kind == "unavailable":
                        raise ReplicaFailed(item.message)  # its engine is down or restarting: try another
                    if isinstance(item, ReplicaError):
                        err = _refusal(item)
                        if not accepted.done():
                            accepted.set_exception(err)
                        else:
                            stream.queue.put_nowait(err if isinstance(err, EngineUnavailableError)
                                                    else EngineUnavailableError(item.message))
                        return
                    now = time.monotonic()
                    if item.new_token_ids:
                        req.output_token_ids += item.new_token_ids
                        if rm is not None:
                            rm.generated(replica, len(item.new_token_ids))
                        if m is not None:
                            if first is None:
                                first = now
                                m.observe_first_output(now - arrival, len(req.prompt_token_ids))
                            m.observe_output(len(item.new_token_ids), None if last is None else now - last)
                        last = now
                    stream.queue.put_nowait(item)
                    if item.finished:
                        if m is not None:
                            m.observe_finished(item.finish_reason or "stop", now - arrival,
                                               None if first is None else first - arrival, item.num_output_tokens)
                        return
                raise ReplicaFailed("the replica's stream ended before the request finished")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replica failed, not the request (refusals arrive as ReplicaError items)
                lost = True
                failures += 1
                if failures > self.max_retries or self._stopped:
                    err = EngineUnavailableError(f"replicas failed {failures} times for this request; last: "
                                                 f"{type(e).__name__}: {e}")
                    if not accepted.done():
                        accepted.set_exception(err)
                    else:
                        stream.queue.put_nowait(err)
                    return
                logger.warning("request %s: replica %s failed (%s: %s); resuming elsewhere after %d tokens",
                               req.request_id, replica, type(e).__name__, e, len(req.output_token_ids))
                await asyncio.sleep(self.retry_backoff_s * failures)
            finally:
                if replica is not None and rm is not None:
                    rm.closed(replica, lost)
