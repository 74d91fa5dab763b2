"""What the ingress and a replica pass each other through Ray Serve handles (Ray's own channel, no socket of ours).

A replica answers a request with a stream of items: ``Accepted``, the engine's ``RequestDelta``s (a
``ReplicaStats`` before the last)
(engine/core/outputs.py), or one ``ReplicaError`` that ends the stream. A refusal is an item, not a raised
exception, so that any exception the handle raises is a replica that failed (died, unreachable): the ingress
retries those elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplicaRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    priority: int = 0
    # Tokens another replica already streamed for this request: it resumes after them (engine.add_request's
    # output_token_ids, as after an engine restart), so the client sees no repeat and greedy output is unchanged.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class Accepted:
    """The first item of every accepted request's stream: the engine took it; which replica holds it."""

    replica: str


@dataclass
class ReplicaStats:
    """The replica's engine counters (cumulative ``EngineStats``), sent just before a stream's last delta: the
    ingress sums the latest of every replica into the server's usual spec-decode and prefix-cache metrics."""

    replica: str
    stats: Any  # EngineStats


@dataclass
class ReplicaError:
    kind: str  # "invalid" (a 400), "overloaded" (a 429), "unavailable" (a 503), "internal" (a 500)
    message: str
    retry_after_s: float = 1.0
