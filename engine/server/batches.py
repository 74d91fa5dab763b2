"""OpenAI's Files and Batch API on ``specserve serve``: ``batch_router(store)`` for ``build_app(extra_routers=)``.

```
POST   /v1/files                  multipart upload (file, purpose=batch), copied to the store in chunks
GET    /v1/files[/{id}]           file objects;  GET /v1/files/{id}/content streams the bytes
DELETE /v1/files/{id}
POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata}
GET    /v1/batches[/{id}]         batch objects (list: newest first, ?limit=&after=)
POST   /v1/batches/{id}/cancel
```

The router's lifespan starts the batch runner on the server's event loop once the engine loop runs (and
stops it first at shutdown), so jobs a killed server left unfinished resume as soon as it is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, File, Form, Query, Request, UploadFile
from pydantic import BaseModel, ConfigDict
from starlette.responses import StreamingResponse

from engine.jobs.runner import BatchRunner
from engine.jobs.store import InvalidRequestError, JobStore, NotFoundError
from engine.server.batch_executor import ServingExecutor
from engine.server.serving import APIError


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _store(request: Request) -> JobStore:
    return request.app.state.job_store


def _runner(request: Request) -> BatchRunner:
    return request.app.state.batch_runner


async def _call(fn, *args: Any, **kwargs: Any) -> Any:
    """A store call off the event loop, its errors in OpenAI's shape."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except NotFoundError as e:
        raise APIError(404, str(e)) from None
    except InvalidRequestError as e:
        raise APIError(400, str(e), e.param) from None


def batch_router(store: JobStore, *, max_in_flight: int = 32, poll_s: float = 1.0,
                 retry_s: float = 1.0) -> APIRouter:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = BatchRunner(store, ServingExecutor(app.state.serving), max_in_flight=max_in_flight, poll_s=poll_s,
                             retry_s=retry_s)
        app.state.job_store = store
        app.state.batch_runner = runner
        runner.start()
        try:
            yield
        finally:
            await runner.stop()

    router = APIRouter(lifespan=lifespan)

    @router.post("/v1/files")
    async def create_file(request: Request, file: Annotated[UploadFile, File()],
                          purpose: Annotated[str, Form()]) -> dict:
        # python-multipart has already spooled the upload to a temporary file; it is copied in chunks.
        return await _call(_store(request).create_file, file.file, file.filename or "upload.jsonl", purpose)

    @router.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000), after: str | None = None) -> dict:
        data = await _call(_store(request).list_files, purpose, limit, after)
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> dict:
        return await _call(_store(request).get_file, file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> StreamingResponse:
        store = _store(request)
        await _call(store.get_file, file_id)
        return StreamingResponse(store.iter_file(file_id), media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> dict:
        return await _call(_store(request).delete_file, file_id)

    @router.post("/v1/batches")
    async def create_batch(request: Request, body: CreateBatchRequest) -> dict:
        batch = await _call(_store(request).create_batch, body.input_file_id, body.endpoint,
                            body.completion_window, body.metadata)
        _runner(request).wake()
        return batch

    @router.get("/v1/batches")
    async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
        data, more = await _call(_store(request).list_batches, limit, after)
        return {"object": "list", "data": data, "has_more": more,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> dict:
        return await _call(_store(request).get_batch, batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict:
        batch = await _call(_store(request).cancel_batch, batch_id)
        _runner(request).wake()
        return batch

    return router
