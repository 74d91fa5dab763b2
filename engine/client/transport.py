"""The HTTP connection settings both clients share, and when and how long to wait before a retry.

Transient failures — HTTP 429 / 502 / 503 / 504 (honouring Retry-After) and connection errors — are retried with
exponential backoff for up to ``retry_timeout_s`` seconds; a POST is retried only when the server cannot have
seen it (connection refused) or told us to (429 / 503).
"""

from __future__ import annotations

import random

import httpx

RETRY_STATUS = (429, 502, 503, 504)


def retry_delay(attempt: int, resp: httpx.Response | None) -> float:
    if resp is not None and (ra := resp.headers.get("retry-after")):
        try:
            return min(float(ra), 30.0)
        except ValueError:
            pass
    return min(0.25 * 2 ** attempt, 8.0) * (0.5 + random.random() / 2)


def retryable(method: str, exc: Exception) -> bool:
    # A refused connection never reached the server; other transport errors may have, so only reads retry.
    return isinstance(exc, httpx.ConnectError) or (method == "GET" and isinstance(exc, httpx.TransportError))


class ClientBase:
    """Where and how both clients connect: base URL, bearer key, timeouts, the model name once known."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 retry_timeout_s: float = 300.0, model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.retry_timeout_s = retry_timeout_s
        self._model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._kw = {"base_url": self.base_url, "headers": headers, "timeout": timeout_s}
