"""The requests the engine loop thread has admitted and not yet finished.

For each: its latency timings (the metrics' histograms) and the tokens its stream has been sent, so that after
an engine restart it can be re-admitted into the new engine and go on without repeating text. Loop thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.server.metrics import ServerMetrics
from engine.server.streams import ACCEPTED, AbortCommand, EngineUnavailableError, LiveRequest, RequestTiming

logger = logging.getLogger("specserve.server")


class OpenRequests:
    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self.timings: dict[str, RequestTiming] = {}
        self.live: dict[str, LiveRequest] = {}

    def __len__(self) -> int:
        return len(self.live)

    def apply(self, engine: Any, cmd: Any) -> tuple[str, Any] | None:
        """An add or abort command into the engine; the add's acknowledgement (or its error) for its stream."""
        if isinstance(cmd, AbortCommand):
            self.live.pop(cmd.request_id, None)
            timing = self.timings.pop(cmd.request_id, None)
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
        self.timings[cmd.request_id] = RequestTiming(cmd.arrival)
        self.live[cmd.request_id] = LiveRequest(cmd, [])
        return cmd.request_id, ACCEPTED

    def observe(self, d: Any, now: float) -> bool:
        """Latency metrics of one delta, and its tokens noted for a restart; False for a request that was aborted
        (nobody reads it)."""
        t = self.timings.get(d.request_id)
        if t is None:
            return False
        r = self.live.get(d.request_id)
        if r is not None:
            if d.finished:
                del self.live[d.request_id]
            else:
                r.output_token_ids += d.new_token_ids
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
            del self.timings[d.request_id]
            if m is not None:
                m.observe_finished(d.finish_reason or "stop", now - t.arrival,
                                   None if t.first is None else t.first - t.arrival, d.num_output_tokens)
        return True

    def readmit(self, engine: Any) -> list[tuple[str, Any]]:
        """Every open request into a new engine from its tokens so far; returns (id, error) for each that cannot
        be resumed (dropped here: its stream ends with a clear error, never a traceback)."""
        failed: list[tuple[str, Any]] = []
        for rid, r in list(self.live.items()):
            a = r.add
            try:
                if isinstance(a.prompt, str):  # no token ids to resume from (the routes always send ids)
                    if r.output_token_ids:
                        raise ValueError("prompt: a text prompt cannot be resumed mid-stream")
                    engine.add_request(rid, a.prompt, a.params, **({"priority": a.priority} if a.priority else {}))
                else:
                    extra = {"priority": a.priority} if a.priority else {}
                    if r.output_token_ids:
                        extra["output_token_ids"] = list(r.output_token_ids)
                    engine.add_request(rid, list(a.prompt), a.params, **extra)
            except Exception as e:
                logger.warning("could not resume request %s after the engine restart: %s", rid, e)
                self.live.pop(rid)
                self.timings.pop(rid, None)
                failed.append((rid, EngineUnavailableError(
                    f"the engine restarted after a failed step and this request could not be resumed ({e}); "
                    "send it again")))
        return failed
