"""API-key authentication: ``Authorization: Bearer KEY`` on every route but ``/health`` and ``/metrics``.

The check is a plain ASGI middleware, so it runs before routing and body parsing (a request without the key
learns nothing about the body it sent) and covers routers added later (``extra_routers``) without each
route having to ask for it. Everything is protected unless listed open: a new route is never open by mistake.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics"})
API_KEY_ENV = "SPECSERVE_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def resolve_api_key(host: str, api_key: str | None) -> str | None:
    """The key to require (flag, else environment), or None; refuses a non-loopback bind without one."""
    key = api_key if api_key else os.environ.get(API_KEY_ENV) or None
    if key is None and not is_loopback(host):
        raise ValueError(f"--host {host} is reachable from other machines: set --api-key KEY (or the "
                         f"{API_KEY_ENV} environment variable) to require 'Authorization: Bearer KEY', or bind "
                         "127.0.0.1")
    return key


def tenant_of(api_key: str | None, served_model: str) -> str | None:
    """Who a request came from, as the engine's cross-request caches scope it (the suffix cache): a digest of the
    API key and the served model name, so the key itself is never kept; None without a key (one local user)."""
    if not api_key:
        return None
    return hashlib.sha256(f"specserve-tenant\0{served_model}\0{api_key}".encode()).hexdigest()[:32]


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # Header values arrive latin-1 decoded: encode back to the bytes the client sent. compare_digest: the
        # time taken does not depend on how much of the key matched.
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            await self.app(scope, receive, send)
            return
        if self._on_reject is not None:
            self._on_reject()
        body = {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer KEY'",
                          "type": "AuthenticationError", "param": None, "code": 401}}
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
