"""The front door's limits: how big a request body may be, and how long a client may take to send one.

```
connection ──▶ H11 protocol (``limited_protocol``)       headers not complete within header_timeout_s: dropped
               │                                         (408, closed) before any route or the key is looked at
               ▼
            BodyLimitMiddleware (outermost ASGI layer)   Content-Length over the limit: 413 at once, body unread;
               │                                         streamed / chunked bytes counted as they arrive: 413 the
               │                                         moment they pass it; the whole body not in within
               ▼                                         body_timeout_s of the headers: 408; both close the
            auth, routes ...                             connection (the app sees the client as gone)
```

A response sent while the client is still sending (an early 401, 404 or 413) closes the connection, so a client
cannot keep one open by trickling a body nobody reads. Drops and refusals are counted in the metrics
(``specserve:slow_clients_dropped_total{phase}``, ``request_errors_total{error="too_large"}``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MiB = 2**20
UPLOAD_PATHS = frozenset({"/v1/files"})  # multipart uploads: their own, larger limit


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * MiB  # an API body (JSON); larger bodies cost parse time and memory on the event loop
    max_upload_bytes: int = 512 * MiB  # a /v1/files upload (spooled to disk); bigger batch files need several
    header_timeout_s: float = 10.0  # from a connection's start (or a kept-alive one's next first byte) to complete
    # headers; slow links need more, a lower value frees connections held by stalled clients sooner
    body_timeout_s: float = 60.0  # from complete headers to the whole body; a large upload over a slow link
    # needs more, a lower value drops trickling clients sooner
    # After a 413, the rest of the body is read and dropped (at most this long, and at most linger_bodies times
    # the limit) before the answer goes out: a client that sends its whole body before reading (most do) then
    # reads the 413 instead of a reset (closing a socket with unread input resets it, which can drop the answer in
    # flight). More: bigger bodies answered cleanly, more bytes read for nothing from an oversized sender.
    linger_s: float = 5.0
    linger_bodies: int = 4

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_upload_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} must be > 0 seconds, got {getattr(self, name)}")

    def body_limit(self, path: str) -> tuple[int, str]:
        """(bytes, the flag that sets it) for a request to ``path``."""
        if path in UPLOAD_PATHS:
            return self.max_upload_bytes, "--max-upload-bytes"
        return self.max_body_bytes, "--max-body-bytes"


def _error(status: int, message: str, close: bool = True) -> tuple[dict, bytes]:
    kind = {408: "RequestTimeoutError", 413: "RequestTooLargeError"}[status]
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return ({"type": "http.response.start", "status": status,
             "headers": headers + [(b"connection", b"close")] * close}, body)


class BodyLimitMiddleware:
    """Refuses bodies past the limit (413) or slower than ``body_timeout_s`` (408), before any other layer.

    ``on_too_large()`` and ``on_slow("body")`` count them (metrics); both may be None.
    """

    def __init__(self, app: ASGIApp, limits: ServerLimits, on_too_large: Callable[[], None] | None = None,
                 on_slow: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.limits = limits
        self._on_too_large = on_too_large
        self._on_slow = on_slow

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flag = self.limits.body_limit(scope["path"])
        too_large = f"request body over {limit} bytes ({flag}={limit})"
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            drained = await _drain(receive, self.limits.linger_s, self.limits.linger_bodies * limit)
            await self._refuse(send, 413, f"{too_large}: Content-Length is {declared}", close=not drained)
            return
        deadline = time.monotonic() + self.limits.body_timeout_s
        received = 0
        # h11's rule: a request has a body only with a Content-Length above 0 or a Transfer-Encoding.
        body_done = declared in (None, "0") and "transfer-encoding" not in Headers(scope=scope)
        started = False  # a response has begun (ours or the app's)
        refused = False  # ours: the app's own sends are dropped from here on

        async def limited_receive() -> Message:
            nonlocal received, body_done, refused
            if refused:
                return {"type": "http.disconnect"}
            if body_done:  # past the body the app only waits for a disconnect: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                if self._on_slow is not None:
                    self._on_slow("body")
                refused = True
                if not started:
                    await self._refuse(send, 408, f"request body not received within {self.limits.body_timeout_s:g}"
                                                  " s (--body-timeout)")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    refused = True
                    if not started:
                        drained = body_done or await _drain(receive, self.limits.linger_s,
                                                            self.limits.linger_bodies * limit)
                        await self._refuse(send, 413, f"{too_large}: {received} bytes received so far",
                                           close=not drained)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
                if not body_done:  # answered before the body was read: nobody will read the rest
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # The app met the disconnect we gave it (ClientDisconnect and the like): the answer has gone out.

    async def _refuse(self, send: Send, status: int, message: str, close: bool = True) -> None:
        """The error answer; ``close``: the connection closes after it (its body was not read to the end)."""
        if status == 413 and self._on_too_large is not None:
            self._on_too_large()
        start, body = _error(status, message, close)
        await send(start)
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, seconds: float, max_bytes: int) -> bool:
    """Read and drop what is left of a request body, for at most ``seconds`` and ``max_bytes`` (nothing kept);
    True when the body was read to its end (the connection can then stay open: no reset can lose the answer)."""
    deadline, dropped = time.monotonic() + seconds, 0
    while (left := deadline - time.monotonic()) > 0 and dropped <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request":
            return False
        if not message.get("more_body", False):
            return True
        dropped += len(message.get("body", b""))
    return False


_LATE_HEADERS = b"request headers not received in time (--header-timeout)\n"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_LATE_HEADERS)).encode() + b"\r\n\r\n" + _LATE_HEADERS)


def limited_protocol(header_timeout_s: float, on_slow: Callable[[str], None] | None = None) -> type:
    """uvicorn's h11 protocol with a deadline on the request headers (uvicorn has none: a client that sends
    half a request line holds its connection forever). Pass as ``uvicorn.Config(http=...)``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if on_slow is not None:
                on_slow("headers")
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a new connection owes its first request's headers

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # the first bytes of the next request on a kept-alive
                self._arm()  # connection (an idle one is uvicorn's keep-alive timeout's business)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole request line and headers arrived
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
