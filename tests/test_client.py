"""engine/client/ without a server: retries, error types, SSE parsing and batch helpers (httpx mock transport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.client import AsyncClient, Client, RequestError, ServerError


def _client(handler, cls=Client, **kw):
    c = cls("http://test", model="m", retry_timeout_s=kw.pop("retry_timeout_s", 5.0), **kw)
    transport = httpx.MockTransport(handler)
    c._http = (httpx.Client if cls is Client else httpx.AsyncClient)(base_url="http://test", transport=transport)
    return c


def _ok(text: str = "hi") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def test_429_and_503_are_retried_with_retry_after() -> None:
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(json.loads(req.content))
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})
        if len(calls) == 2:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "restarting"}})
        return _ok("done")

    out = _client(handler).complete("p", max_tokens=3, temperature=0)
    assert out.text == "done" and out.finish_reason == "length" and len(calls) == 3
    assert calls[0] == {"model": "m", "prompt": "p", "max_tokens": 3, "temperature": 0}


def test_a_4xx_raises_request_error_at_once_with_the_servers_message() -> None:
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        return httpx.Response(400, json={"error": {"message": "max_tokens must be >= 1, got 0"}})

    with pytest.raises(RequestError, match=r"HTTP 400: max_tokens must be >= 1, got 0") as e:
        _client(handler).complete("p", max_tokens=0)
    assert e.value.status_code == 400 and len(calls) == 1


def test_refused_connections_are_retried_but_a_post_that_may_have_arrived_is_not() -> None:
    state = {"n": 0}

    def refused_then_ok(req: httpx.Request) -> httpx.Response:
        state["n"] += 1
        if state["n"] < 3:
            raise httpx.ConnectError("refused", request=req)
        return _ok()

    assert _client(refused_then_ok).complete("p").text == "hi" and state["n"] == 3

    def read_error(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=req)

    with pytest.raises(httpx.ReadError):
        _client(read_error).complete("p")


def test_retrying_gives_up_after_the_retry_budget() -> None:
    def always_503(req: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "0.05"}, json={"error": {"message": "down"}})

    with pytest.raises(ServerError, match="down"):
        _client(always_503, retry_timeout_s=0.3).complete("p")


def test_stream_yields_text_pieces_and_surfaces_a_mid_stream_error() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "", "bc")]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    assert list(_client(handler).stream("p", max_tokens=3)) == ["a", "bc"]

    def dying(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text='data: {"choices": [{"text": "a"}]}\n\n'
                                        'data: {"error": {"message": "gone"}}\n\n')

    with pytest.raises(ServerError, match="gone"):
        list(_client(dying).stream("p"))


def test_batch_job_results_errors_and_wait() -> None:
    out_rows = [{"id": "r", "custom_id": "a", "response": {"status_code": 200, "body": {"x": 1}}, "error": None}]
    err_rows = [{"id": "r", "custom_id": "b", "response": {"status_code": 400, "body": {"error": {"message": "bad"}}},
                 "error": None},
                {"id": "r", "custom_id": None, "response": None,
                 "error": {"code": "invalid_json_line", "message": "l"}}]
    polls = {"n": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/batches/batch_1":
            polls["n"] += 1
            status = "completed" if polls["n"] >= 3 else "in_progress"
            return httpx.Response(200, json={"id": "batch_1", "status": status, "output_file_id": "fo",
                                             "error_file_id": "fe",
                                             "request_counts": {"total": 3, "completed": 1, "failed": 2}})
        rows = out_rows if req.url.path == "/v1/files/fo/content" else err_rows
        return httpx.Response(200, text="".join(json.dumps(r) + "\n" for r in rows))

    job = _client(handler).job("batch_1")
    assert job.wait(poll_s=0.01)["status"] == "completed" and polls["n"] == 3
    assert list(job.results()) == [("a", {"x": 1})]
    assert list(job.errors()) == [("b", {"message": "bad"}), (None, {"code": "invalid_json_line", "message": "l"})]


def test_async_client_retries_the_same_way() -> None:
    state = {"n": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        state["n"] += 1
        if state["n"] == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "x"}})
        return _ok("async")

    async def go() -> str:
        c = _client(handler, cls=AsyncClient)
        try:
            return (await c.complete("p")).text
        finally:
            await c.aclose()

    assert asyncio.run(go()) == "async" and state["n"] == 2
