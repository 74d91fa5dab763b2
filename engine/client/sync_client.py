"""``Client``: online calls and batch jobs over a blocking httpx connection, retried (transport.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from engine.client.batch_progress import TERMINAL, update_bar
from engine.client.errors import error_of
from engine.client.openai_format import Completion, completion_of, spool, sse_data, text_piece
from engine.client.transport import RETRY_STATUS, ClientBase, retry_delay, retryable


class Client(ClientBase):
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
                err: Exception = error_of(resp)
                if resp.status_code not in RETRY_STATUS:
                    raise err
            except httpx.TransportError as e:
                if not retryable(method, e):
                    raise
                err = e
            if time.monotonic() >= deadline:
                raise err
            time.sleep(retry_delay(attempt, resp))
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
        return completion_of(self._json("POST", "/v1/completions", json=body), chat=False)

    def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        body = {"model": sampling.pop("model", None) or self.model(), "messages": messages, **sampling}
        return completion_of(self._json("POST", "/v1/chat/completions", json=body), chat=True)

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               **sampling: Any) -> Iterator[str]:
        """Text pieces as they are generated (a prompt, or chat ``messages``)."""
        chat = messages is not None
        body = {"model": sampling.pop("model", None) or self.model(),
                ("messages" if chat else "prompt"): messages if chat else prompt, **sampling, "stream": True}
        resp = self._request("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body, stream=True)
        try:
            for chunk in sse_data(resp.iter_lines()):
                if piece := text_piece(chunk, chat):
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
        path, temporary = spool(requests_or_path, endpoint)
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
                    bar = update_bar(bar, b)
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
