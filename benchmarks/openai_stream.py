"""One streaming request to an OpenAI-compatible server, timed on the client's own clock.

Every server-sent event line is timestamped when the client reads it. TTFT is the time from just before the
request is sent to the first chunk that carries output text; ITL are the gaps between successive chunks that
carry text (a chunk may hold several tokens — speculation emits in bursts — so ITL is per chunk, as in vLLM);
E2EL runs to the end of the stream. Output token counts come from the ``usage`` the server reports
(``stream_options.include_usage``), not from counting chunks; TPOT = (E2EL - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.workload import BenchRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_BODY_CHARS = 500  # enough of an error body to say what went wrong


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; ``send_time`` is from the start of the benchmark."""

    index: int
    request_id: str
    success: bool = False
    error: str | None = None
    send_time: float = 0.0
    ttft: float | None = None  # first chunk with text (or token ids: a model without a tokenizer) - send
    itl: list[float] = field(default_factory=list)  # gaps between such chunks
    e2el: float | None = None  # end of stream - send
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "usage"  # "usage", or "chunks" when the server gave no usage
    text_chunks: int = 0
    generated_text: str | None = None  # kept only when asked (it can be large)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def request_body(req: BenchRequest, endpoint: str, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = dict(req.params)
    if model is not None:
        body["model"] = model
    if endpoint == CHAT:
        if not isinstance(req.prompt, str):
            raise ValueError(f"request {req.request_id}: the chat endpoint needs a text prompt, not token ids")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:  # chat
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _chunk_has_tokens(obj: dict[str, Any]) -> bool:
    choices = obj.get("choices") or []
    return bool(choices and choices[0].get("token_ids"))


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord,
                       t0: float, headers: dict[str, str] | None = None, timeout_s: float | None = None,
                       keep_text: bool = False) -> RequestRecord:
    """Sends one streaming request and fills ``record``; never raises for a failed request (the error is kept
    in the record). ``t0``: the benchmark's start on the ``time.perf_counter`` clock."""
    start = time.perf_counter()
    record.send_time = start - t0
    try:
        await asyncio.wait_for(_stream(client, url, body, record, start, headers, keep_text), timeout_s)
    except asyncio.TimeoutError:
        record.success, record.error = False, f"timeout: no complete response within {timeout_s} s"
    except httpx.HTTPError as e:
        record.success, record.error = False, f"{type(e).__name__}: {e}"
    if not record.success:
        record.e2el = time.perf_counter() - start
    return record


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord, start: float,
                  headers: dict[str, str] | None, keep_text: bool) -> None:
    text: list[str] = []
    last: float | None = None
    done = False
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raw = (await resp.aread()).decode("utf-8", "replace")
            rec.error = f"HTTP {resp.status_code}: {raw[:ERROR_BODY_CHARS]}"
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter()  # the client's clock, at the moment the event is read
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                rec.e2el = now - start  # the end of the stream, not of closing the connection
                done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                rec.error = f"malformed event: {data[:ERROR_BODY_CHARS]}"
                return
            if obj.get("error"):
                rec.error = f"error event: {json.dumps(obj['error'])[:ERROR_BODY_CHARS]}"
                return
            piece = _chunk_text(obj)
            if piece or _chunk_has_tokens(obj):  # a model without a tokenizer streams token ids, no text
                if last is None:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                last = now
                rec.text_chunks += 1
                if keep_text:
                    text.append(piece)
            usage = obj.get("usage")
            if usage:
                rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                if usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
    if not done:
        rec.error = "the stream ended without [DONE]"
        return
    if rec.output_tokens == 0 and rec.text_chunks:
        rec.output_tokens, rec.output_tokens_source = rec.text_chunks, "chunks"
    if keep_text:
        rec.generated_text = "".join(text)
    rec.success = True


async def fetch_model_id(client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None) -> str | None:
    """The first model the server lists at /v1/models, or None if it lists none."""
    try:
        r = await client.get(base_url + "/v1/models", headers=headers)
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None
