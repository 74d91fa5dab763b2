"""A Python client for ``specserve serve``: online calls and batch jobs, with retries that outlast a restart.

```python
from engine.client import Client
c = Client("http://127.0.0.1:8000")
c.complete("def fib(n):", max_tokens=32).text
for piece in c.stream("def fib(n):", max_tokens=32): print(piece, end="")
job = c.submit_batch([{"prompt": "def f():", "max_tokens": 16}, ...])    # or a path to an OpenAI batch file
job.wait(progress=True)                                                   # tqdm bar of completed/failed/total
for custom_id, body in job.results(): ...                                 # streamed from the output file
```

It lives in ``engine/`` beside the server it talks to (the DESIGN map puts the client there) and needs only
httpx. ``AsyncClient`` has the same surface with ``async``. Transient failures — HTTP 429 / 503 (honouring
Retry-After) and connection errors — are retried with exponential backoff for up to ``retry_timeout_s``
seconds, so ``BatchJob.wait`` rides out a server restart; a POST is retried only when the server cannot have
seen it (connection refused) or told us to (429 / 503). Other 4xx raise ``RequestError`` at once, with the
server's message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

TERMINAL = ("completed", "failed", "cancelled", "expired")
_RETRY_STATUS = (429, 502, 503, 504)


class APIError(Exception):
    """The server answered with an error."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code, self.message, self.body = status_code, message, body


class RequestError(APIError):
    """4xx: the request is wrong (the message names the field); retrying will not help."""


class ServerError(APIError):
    """5xx that did not go away within the retry budget."""


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    raw: dict[str, Any]


def _error_of(resp: httpx.Response) -> APIError:
    try:
        body = resp.json()
        message = body.get("error", {}).get("message") or resp.text
    except (ValueError, AttributeError):
        body, message = None, resp.text
    cls = RequestError if 400 <= resp.status_code < 500 else ServerError
    return cls(resp.status_code, message, body)


def _delay(attempt: int, resp: httpx.Response | None) -> float:
    if resp is not None and (ra := resp.headers.get("retry-after")):
        try:
            return min(float(ra), 30.0)
        except ValueError:
            pass
    return min(0.25 * 2 ** attempt, 8.0) * (0.5 + random.random() / 2)


def _retryable(method: str, exc: Exception) -> bool:
    # A refused connection never reached the server; other transport errors may have, so only reads retry.
    return isinstance(exc, httpx.ConnectError) or (method == "GET" and isinstance(exc, httpx.TransportError))


def _completion(body: dict[str, Any], chat: bool) -> Completion:
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Completion(text, choice.get("finish_reason"), body.get("usage"), body)


def _batch_lines(requests: Iterable[dict[str, Any]], endpoint: str) -> Iterator[str]:
    """OpenAI batch lines from full lines ({"custom_id", "body", ...}) or bare bodies (custom_id = position)."""
    for i, r in enumerate(requests):
        if "body" in r:
            line = {"method": "POST", "url": endpoint, **r}
            line.setdefault("custom_id", str(i))
        else:
            line = {"custom_id": str(i), "method": "POST", "url": endpoint, "body": r}
        yield json.dumps(line) + "\n"


def _spool(requests_or_path: str | os.PathLike[str] | Iterable[dict[str, Any]], endpoint: str) -> tuple[str, bool]:
    """A path to upload: the user's file as is, or the requests written to a temporary file (not memory)."""
    if isinstance(requests_or_path, (str, os.PathLike)):
        return os.fspath(requests_or_path), False
    fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="specserve-batch-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for line in _batch_lines(requests_or_path, endpoint):
            f.write(line)
    return path, True


def _sse_data(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise ServerError(503, obj["error"].get("message", data), obj)
            yield obj


def _piece(chunk: dict[str, Any], chat: bool) -> str:
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    return (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")


class _Base:
    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 retry_timeout_s: float = 300.0, model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.retry_timeout_s = retry_timeout_s
        self._model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._kw = {"base_url": self.base_url, "headers": headers, "timeout": timeout_s}



class Client(_Base):
    def __init__(self, base_url: str, api_key: str | None = None, **kw: Any) -> None:
        super().__init__(base_url, api_key, **kw)
        self._http = httpx.Client(**self._kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_timeout_s
        attempt = 0
        while True:
            resp = None
            try:
                req = self._http.build_request(method, path, **kw)
                resp = self._http.send(req, stream=stream)
                if stream and resp.status_code >= 400:
                    resp.read()
                if resp.status_code < 400:
                    return resp
                err: Exception = _error_of(resp)
                if resp.status_code not in _RETRY_STATUS:
                    raise err
            except httpx.TransportError as e:
                if not _retryable(method, e):
                    raise
                err = e
            if time.monotonic() >= deadline:
                raise err
            time.sleep(_delay(attempt, resp))
            attempt += 1

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._request(method, path, **kw).json()

    def model(self) -> str:
        if self._model is None:
            self._model = self._json("GET", "/v1/models")["data"][0]["id"]
        return self._model

    # ---------------------------------------------------------------------------------------------- online
    def complete(self, prompt: str | list[int], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or self.model(), "prompt": prompt, **sampling}
        return _completion(self._json("POST", "/v1/completions", json=body), chat=False)

    def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or self.model(), "messages": messages, **sampling}
        return _completion(self._json("POST", "/v1/chat/completions", json=body), chat=True)

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               **sampling: Any) -> Iterator[str]:
        """Text pieces as they are generated (a prompt, or chat ``messages``)."""
        chat = messages is not None
        body = {"model": sampling.pop("model", None) or self.model(),
                ("messages" if chat else "prompt"): messages if chat else prompt, **sampling, "stream": True}
        resp = self._request("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body, stream=True)
        try:
            for chunk in _sse_data(resp.iter_lines()):
                if piece := _piece(chunk, chat):
                    yield piece
        finally:
            resp.close()

    # ----------------------------------------------------------------------------------------------- batch
    def upload(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        with open(path, "rb") as f:  # httpx streams the file; it is never read whole
            return self._json("POST", "/v1/files", files={"file": (os.path.basename(path), f)},
                              data={"purpose": "batch"})

    def submit_batch(self, requests_or_path: str | os.PathLike[str] | Iterable[dict[str, Any]],
                     endpoint: str = "/v1/completions", metadata: dict[str, str] | None = None) -> BatchJob:
        """Upload and start a job. Items: bare bodies (custom_id = position) or full batch lines."""
        path, temporary = _spool(requests_or_path, endpoint)
        try:
            f = self.upload(path)
        finally:
            if temporary:
                os.unlink(path)
        b = self._json("POST", "/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                                      "completion_window": "24h", "metadata": metadata})
        return BatchJob(self, b["id"], b)

    def job(self, batch_id: str) -> BatchJob:
        return BatchJob(self, batch_id)

    def jobs(self, limit: int | None = None) -> list[BatchJob]:
        """Batch jobs on the server, newest first (every page, or the first ``limit``)."""
        out: list[BatchJob] = []
        after = None
        while limit is None or len(out) < limit:
            page = self._json("GET", "/v1/batches", params={"limit": 100, **({"after": after} if after else {})})
            out += [BatchJob(self, b["id"], b) for b in page["data"]]
            if not page["has_more"] or not page["data"]:
                break
            after = page["last_id"]
        return out if limit is None else out[:limit]

    def _lines(self, file_id: str) -> Iterator[dict[str, Any]]:
        resp = self._request("GET", f"/v1/files/{file_id}/content", stream=True)
        try:
            for line in resp.iter_lines():
                if line:
                    yield json.loads(line)
        finally:
            resp.close()


class BatchJob:
    def __init__(self, client: Client, batch_id: str, last: dict[str, Any] | None = None) -> None:
        self.client, self.id, self.last = client, batch_id, last

    def __repr__(self) -> str:
        return f"BatchJob({self.id!r}, status={self.last['status'] if self.last else None!r})"

    def status(self) -> dict[str, Any]:
        """The batch object (status, request_counts, output_file_id, ...)."""
        self.last = self.client._json("GET", f"/v1/batches/{self.id}")
        return self.last

    def cancel(self) -> dict[str, Any]:
        self.last = self.client._json("POST", f"/v1/batches/{self.id}/cancel")
        return self.last

    def wait(self, progress: bool = False, poll_s: float = 1.0, timeout_s: float | None = None) -> dict[str, Any]:
        """Poll until the job ends (completed, failed, cancelled, expired); returns the batch object."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        bar = None
        try:
            while True:
                b = self.status()
                if progress:
                    bar = _update_bar(bar, b)
                if b["status"] in TERMINAL:
                    return b
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"batch {self.id} still {b['status']} after {timeout_s}s")
                time.sleep(poll_s)
        finally:
            if bar is not None:
                bar.close()

    def results(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(custom_id, response body) of every successful request, streamed from the output file."""
        fid = self.status().get("output_file_id")
        if fid:
            for row in self.client._lines(fid):
                yield row["custom_id"], row["response"]["body"]

    def errors(self) -> Iterator[tuple[str | None, dict[str, Any]]]:
        """(custom_id, error) of every failed request: the error body of a 4xx, or the row's error object."""
        fid = self.status().get("error_file_id")
        if fid:
            for row in self.client._lines(fid):
                err = row["error"] if row.get("error") else row["response"]["body"].get("error", row["response"])
                yield row["custom_id"], err


def _update_bar(bar: Any, b: dict[str, Any]) -> Any:
    from tqdm import tqdm

    c = b["request_counts"]
    if bar is None:
        bar = tqdm(total=c["total"] or None, desc=b["id"], unit="req")
    bar.total = c["total"] or bar.total
    bar.n = c["completed"] + c["failed"]
    bar.set_postfix(status=b["status"], failed=c["failed"], refresh=False)
    bar.refresh()
    return bar


class AsyncClient(_Base):
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
                err: Exception = _error_of(resp)
                if resp.status_code not in _RETRY_STATUS:
                    raise err
            except httpx.TransportError as e:
                if not _retryable(method, e):
                    raise
                err = e
            if time.monotonic() >= deadline:
                raise err
            await asyncio.sleep(_delay(attempt, resp))
            attempt += 1

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._request(method, path, **kw)).json()

    async def model(self) -> str:
        if self._model is None:
            self._model = (await self._json("GET", "/v1/models"))["data"][0]["id"]
        return self._model

    async def complete(self, prompt: str | list[int], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or await self.model(), "prompt": prompt, **sampling}
        return _completion(await self._json("POST", "/v1/completions", json=body), chat=False)

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or await self.model(), "messages": messages, **sampling}
        return _completion(await self._json("POST", "/v1/chat/completions", json=body), chat=True)

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     **sampling: Any) -> AsyncIterator[str]:
        chat = messages is not None
        body = {"model": sampling.pop("model", None) or await self.model(),
                ("messages" if chat else "prompt"): messages if chat else prompt, **sampling, "stream": True}
        resp = await self._request("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body,
                                   stream=True)
        try:
            async for line in resp.aiter_lines():
                for chunk in _sse_data([line]):
                    if piece := _piece(chunk, chat):
                        yield piece
                if line.strip() == "data: [DONE]":
                    return
        finally:
            await resp.aclose()

    async def submit_batch(self, requests_or_path: str | os.PathLike[str] | Iterable[dict[str, Any]],
                           endpoint: str = "/v1/completions", metadata: dict[str, str] | None = None) -> AsyncBatchJob:
        path, temporary = await asyncio.to_thread(_spool, requests_or_path, endpoint)
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
                    bar = _update_bar(bar, b)
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
