"""``AsyncClient``: ``Client``'s surface with ``async`` methods (``stream`` and ``results`` are async iterators)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx

from engine.client.batch_progress import TERMINAL, update_bar
from engine.client.errors import error_of
from engine.client.openai_format import Completion, completion_of, spool, sse_data, text_piece
from engine.client.transport import RETRY_STATUS, ClientBase, retry_delay, retryable


class AsyncClient(ClientBase):
    """``Client`` with ``async`` methods (``stream`` and ``results`` are async iterators)."""

    def __init__(self, base_url: str, api_key: str | None = None, **kw: Any) -> None:
        super().__init__(base_url, api_key, **kw)
        self._http = httpx.AsyncClient(**self._kw)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_timeout_s
        attempt = 0
        while True:
            resp = None
            try:
                resp = await self._http.send(self._http.build_request(method, path, **kw), stream=stream)
                if stream and resp.status_code >= 400:
                    await resp.aread()
                if resp.status_code < 400:
                    return resp
                err: Exception = error_of(resp)
                if resp.status_code not in RETRY_STATUS:
                    raise err
            except httpx.TransportError as e:
                if not retryable(method, e):
                    raise
                err = e
            if time.monotonic() >= deadline:
                raise err
            await asyncio.sleep(retry_delay(attempt, resp))
            attempt += 1

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._request(method, path, **kw)).json()

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self._json("GET", "/v1/models"))["data"][0]["id"]
        return self._model

    async def complete(self, prompt: str | list[int], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or await self.model(), "prompt": prompt, **sampling}
        return completion_of(await self._json("POST", "/v1/completions", json=body), chat=False)

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or await self.model(), "messages": messages, **sampling}
        return completion_of(await self._json("POST", "/v1/chat/completions", json=body), chat=True)

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     **sampling: Any) -> AsyncIterator[str]:
        chat = messages is not None
        body = {"model": sampling.pop("model", None) or await self.model(),
                ("messages" if chat else "prompt"): messages if chat else prompt, **sampling, "stream": True}
        resp = await self._request("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body,
                                   stream=True)
        try:
            async for line in resp.aiter_lines():
                for chunk in sse_data([line]):
                    if piece := text_piece(chunk, chat):
                        yield piece
                if line.strip() == "data: [DONE]":
                    return
        finally:
            await resp.aclose()

    async def submit_batch(self, requests_or_path: str | os.PathLike[str] | Iterable[dict[str, Any]],
                           endpoint: str = "/v1/completions", metadata: dict[str, str] | None = None) -> AsyncBatchJob:
        path, temporary = await asyncio.to_thread(spool, requests_or_path, endpoint)
        try:
            with open(path, "rb") as f:
                up = await self._json("POST", "/v1/files", files={"file": (os.path.basename(path), f)},
                                      data={"purpose": "batch"})
        finally:
            if temporary:
                os.unlink(path)
        b = await self._json("POST", "/v1/batches", json={"input_file_id": up["id"], "endpoint": endpoint,
                                                            "completion_window": "24h", "metadata": metadata})
        return AsyncBatchJob(self, b["id"], b)

    def job(self, batch_id: str) -> AsyncBatchJob:
        return AsyncBatchJob(self, batch_id)

    async def jobs(self, limit: int | None = None) -> list[AsyncBatchJob]:
        out: list[AsyncBatchJob] = []
        after = None
        while limit is None or len(out) < limit:
            page = await self._json("GET", "/v1/batches",
                                    params={"limit": 100, **({"after": after} if after else {})})
            out += [AsyncBatchJob(self, b["id"], b) for b in page["data"]]
            if not page["has_more"] or not page["data"]:
                break
            after = page["last_id"]
        return out if limit is None else out[:limit]

    async def _lines(self, file_id: str) -> AsyncIterator[dict[str, Any]]:
        resp = await self._request("GET", f"/v1/files/{file_id}/content", stream=True)
        try:
            async for line in resp.aiter_lines():
                if line:
                    yield json.loads(line)
        finally:
            await resp.aclose()


class AsyncBatchJob:
    def __init__(self, client: AsyncClient, batch_id: str, last: dict[str, Any] | None = None) -> None:
        self.client, self.id, self.last = client, batch_id, last

    async def status(self) -> dict[str, Any]:
        self.last = await self.client._json("GET", f"/v1/batches/{self.id}")
        return self.last

    async def cancel(self) -> dict[str, Any]:
        self.last = await self.client._json("POST", f"/v1/batches/{self.id}/cancel")
        return self.last

    async def wait(self, progress: bool = False, poll_s: float = 1.0,
                   timeout_s: float | None = None) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        bar = None
        try:
            while True:
                b = await self.status()
                if progress:
                    bar = update_bar(bar, b)
                if b["status"] in TERMINAL:
                    return b
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {self.id} still {b['status']} after {timeout_s}s")
                await asyncio.sleep(poll_s)
        finally:
            if bar is not None:
                bar.close()

    async def results(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        fid = (await self.status()).get("output_file_id")
        if fid:
            async for row in self.client._lines(fid):
                yield row["custom_id"], row["response"]["body"]

    async def errors(self) -> AsyncIterator[tuple[str | None, dict[str, Any]]]:
        fid = (await self.status()).get("error_file_id")
        if fid:
            async for row in self.client._lines(fid):
                err = row["error"] if row.get("error") else row["response"]["body"].get("error", row["response"])
                yield row["custom_id"], err
