"""``build_app(async_engine, config, tokenizer, api_key=..., extra_routers=[...])``: the FastAPI application.

Errors of every kind leave in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): a body that
does not validate is a 400 naming the field (not FastAPI's default 422), an unknown route a 404, an
unexpected exception a 500 (logged; the engine loop is unaffected).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from engine.server.async_engine import AsyncEngine
from engine.server.auth import BearerAuthMiddleware
from engine.server.limits import BodyLimitMiddleware, ServerLimits
from engine.server.routes import router
from engine.server.serving import APIError, ServerConfig, Serving

logger = logging.getLogger("specserve.server")

_ERROR_KINDS = {400: "invalid_request", 404: "invalid_request", 405: "invalid_request", 429: "overloaded",
                503: "engine_dead"}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """'field: what is wrong' for up to three pydantic errors, and the first error's top-level field."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"body: invalid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
            continue
        where = ".".join(loc) or "body"
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (specserve does not support it)"
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
        if param is None and loc:
            param = loc[0]
    if len(errors) > 3:
        parts.append(f"({len(errors) - 3} more)")
    return "; ".join(parts), param


def build_app(async_engine: AsyncEngine, config: ServerConfig, tokenizer: Any, *, api_key: str | None = None,
              extra_routers: Iterable[APIRouter] = (), limits: ServerLimits | None = None) -> FastAPI:
    metrics = async_engine.metrics

    def count(status: int) -> None:
        if metrics is not None:
            metrics.count_error(_ERROR_KINDS.get(status, "internal" if status >= 500 else "invalid_request"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server",
                  lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = Serving(async_engine, config, tokenizer)
    app.include_router(router)
    for extra in extra_routers:
        app.include_router(extra)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        count(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return await _api_error(request, APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        return await _api_error(request, err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key,
                           on_reject=(lambda: metrics.count_error("unauthorized")) if metrics is not None else None)
    # Added last, so outermost: a body too big or too slow is refused before the key is looked at.
    app.add_middleware(BodyLimitMiddleware, limits=limits or ServerLimits(),
                       on_too_large=(lambda: metrics.count_error("too_large")) if metrics is not None else None,
                       on_slow=metrics.count_slow_client if metrics is not None else None)
    return app
