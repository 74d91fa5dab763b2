"""The endpoints: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``; ``/health``, ``/metrics``.

Routes only parse (pydantic, via FastAPI) and hand over to ``Serving``; the app keeps its collaborators on
``app.state`` (``serving``, ``async_engine``, ``metrics``), which extra routers can read the same way.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from engine.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from engine.server.serving import APIError, Serving

router = APIRouter()


def get_serving(request: Request) -> Serving:
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request, serving: ServingDep) -> Response:
    return await serving.completions(body, raw)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request, serving: ServingDep) -> Response:
    return await serving.chat(body, raw)


@router.get("/v1/models")
async def list_models(serving: ServingDep) -> ModelList:
    cfg = serving.config
    return ModelList(data=[ModelCard(id=cfg.served_model_name, root=cfg.model_path,
                                     max_model_len=serving.engine.max_model_len)])


@router.get("/health")
async def health(serving: ServingDep) -> Response:
    """200 ``{"status": "ok"}``; 200 ``{"status": "degraded", "restoring": [roles], ...}`` while the engine
    replaces a dead worker (requests are still admitted; streams pause, then continue); 503 in OpenAI's error
    shape, the reason in its message and ``status`` "restarting" or "down", while there is no engine to serve."""
    h = serving.engine.health()
    if h.status == "ok":
        return JSONResponse({"status": "ok"})
    if h.serving:
        return JSONResponse({"status": h.status, "restoring": list(h.restoring), "message": h.reason})
    body = APIError(503, h.reason or "engine not running").body()
    return JSONResponse({**body, "status": h.status}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    return Response(generate_latest(m.registry) if m is not None else b"", media_type=CONTENT_TYPE_LATEST)
