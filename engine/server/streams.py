"""What the engine loop thread and the front end pass each other: commands in, one stream of deltas per request out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry after ``retry_after_s``."""

    def __init__(self, waiting: int, max_queue: int, retry_after_s: float) -> None:
        super().__init__(f"server overloaded: {waiting} requests waiting (max_queue={max_queue}); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine loop is not running (stopped, restarting, or a step failed and it could not be restarted)."""


@dataclass
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: Any  # SamplingParams
    arrival: float  # time.monotonic() at the front end
    priority: int = 0  # lower is admitted first: batch jobs (engine/jobs/runner.py) use 1


@dataclass
class LiveRequest:
    """An admitted, unfinished request as the loop thread knows it: enough to re-admit it to a new engine."""

    add: AddCommand
    output_token_ids: list[int]  # what its stream has been sent


@dataclass
class AbortCommand:
    request_id: str


STOP = object()
ACCEPTED = object()  # first item of every stream: the engine took the request


@dataclass
class RequestTiming:
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
