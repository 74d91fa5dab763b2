"""From an OpenAI request to engine requests and back: prompts and limits, responses and SSE chunks.

Prompts are tokenized here with the front end's own tokenizer (the same files and the same ``encode`` call as the
engine's), so the engine loop spends its time stepping and a prompt that cannot fit (prompt + max_tokens beyond
the context) is refused with a 400 before it is queued. Tokenizing runs on one thread of its own, off the event
loop (a megabyte of text takes a second: ``/health`` and other requests must not wait for it), one text at a
time as before (a fast tokenizer is not safe to call from two threads at once).
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response

from engine.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestStream
from engine.server.logprobs import CompletionFormat, TokenTexts, chat_logprobs
from engine.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SpecDecodeInfo,
    UsageInfo,
    _now,
)
from scheduler.sampling_params import sample_copies

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
_DONE = format_sse_event(data_str="[DONE]")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def param_of(message: str, fields: set[str]) -> str | None:
    """The request field an engine/SamplingParams message is about: they all start with its name."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in fields else None


@dataclass
class ServerConfig:
    served_model_name: str
    model_path: str | None = None  # shown as the model's root in /v1/models
    # Choices per prompt (n): each is a request of its own in the engine (its KV past the shared prompt, its
    # rounds), so n multiplies a request's cost; beyond this a 400 names n.
    max_n: int = 16


class Serving:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, tokenizer: Any) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the tokenizing thread (prompt rendering and encoding): the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def encode_all(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return await self.off_loop(lambda: [self.encode(p) for p in prompts])

    # ------------------------------------------------------------------------------------------- checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"the model '{model}' does not exist: this server serves "
                                f"'{self.config.served_model_name}'", "model")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; send token ids instead", "prompt")
        return _encode(self.tokenizer, prompt, "prompt")

    def render_chat(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template (tokenizer_config.json "
                                "'chat_template'); use /v1/completions with a prompt", "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (raise_exception), or a template error
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from e
        return _encode(tok, text, "messages", add_special_tokens=False)

    def check_length(self, prompts: list[list[int]], max_tokens: int | None, field: str) -> None:
        limit = self.engine.max_model_len
        for ids in prompts:
            if not ids:
                raise APIError(400, f"{field}: the prompt is empty (at least one token is needed)", field)
            if len(ids) >= limit:
                raise APIError(400, f"{field}: {len(ids)} tokens, the model's context is {limit} (prompt + at "
                                    "least one generated token must fit)", field)
            if max_tokens is not None and len(ids) + max_tokens > limit:
                name = "max_tokens"
                raise APIError(400, f"{name}: {max_tokens} + the prompt's {len(ids)} tokens exceed the model's "
                                    f"context of {limit} tokens (max_tokens <= {limit - len(ids)})", name)

    def sampling_params(self, req: Any, max_tokens: int) -> list[Any]:
        """One SamplingParams per choice (``n``: independent samples, scheduler/sampling_params.py sample_copies)."""
        n = 1 if req.n is None else req.n
        if n > self.config.max_n:
            raise APIError(400, f"n: {n} choices per prompt, more than this server's max_n = {self.config.max_n}", "n")
        try:
            return sample_copies(req.sampling_params(max_tokens, self.engine.vocab_size), n)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e), set(type(req).model_fields))) from e

    async def submit(self, base_id: str, prompts: list[list[int]], params: list[Any],
                     field: str, priority: int = 0) -> list[RequestStream]:
        """Queue every prompt at once (one engine iteration acknowledges them all); all or nothing.
        ``priority``: 0 online; batch jobs submit at 1 so online requests go first."""
        ae = self.engine
        if len(prompts) > ae.capacity:  # a 429 would send the client back forever: it can never fit
            raise APIError(400, f"{field}: {len(prompts)} prompts in one request, more than this server can ever "
                                f"hold at once (--max-num-seqs {ae.max_num_seqs} running + --max-queue "
                                f"{ae.max_queue} waiting = {ae.capacity}); split the request", field)
        results = await asyncio.gather(*[self.engine.add_request(f"{base_id}-{i}", p, sp, priority=priority)
                                         for i, (p, sp) in enumerate(zip(prompts, params, strict=True))],
                                       return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if not errors:
            return streams
        for s in streams:
            self.engine.abort(s.request_id)
        e = errors[0]
        if isinstance(e, QueueFullError):
            raise APIError(429, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
        if isinstance(e, EngineUnavailableError):
            raise APIError(503, str(e))
        if isinstance(e, ValueError):
            p = param_of(str(e), {"prompt", "prompt_token_ids", "max_tokens", "stop", "stop_token_ids",
                                  "structured_outputs"})
            raise APIError(400, str(e), field if p in ("prompt", "prompt_token_ids") else p)
        raise e

    # ------------------------------------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        prompts = await self.encode_all(req.prompts())
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        copies = self.sampling_params(req, max_tokens)
        self.check_length(prompts, max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        # choice i * n + j: prompt i's sample j (OpenAI's order)
        streams = await self.submit(rid, [p for p in prompts for _ in copies], copies * len(prompts), "prompt")
        prompt_tokens = sum(len(p) for p in prompts)
        ids = self.tokenizer is None if req.return_token_ids is None else req.return_token_ids
        fmt = CompletionFormat(TokenTexts(self.tokenizer), [p for p in req.prompts() for _ in copies],
                               [p for p in prompts for _ in copies], bool(req.echo), req.logprobs is not None)
        if req.stream:
            return EventSourceResponse(self._completion_events(rid, streams, prompt_tokens, req.include_usage, ids,
                                                               fmt))
        results = await self._collect_unless_gone(streams, raw)
        if results is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return _json(CompletionResponse(
            id=rid, model=self.config.served_model_name,
            choices=[CompletionChoice(index=i, **fmt.whole(i, r.text, r.token_ids, r.logprobs, r.prompt_logprobs),
                                      finish_reason=r.finish_reason, token_ids=r.token_ids if ids else None)
                     for i, r in enumerate(results)],
            usage=_usage(prompt_tokens, results), spec_decode=SpecDecodeInfo.combine([r.metrics for r in results])))

    async def _completion_events(self, rid: str, streams: list[RequestStream], prompt_tokens: int,
                                 include_usage: bool, token_ids: bool, fmt: CompletionFormat) -> AsyncIterator[bytes]:
        created, model = _now(), self.config.served_model_name
        finals: dict[int, Any] = {}
        try:
            async for i, d in self._merged(streams):
                if not d.new_text and not d.finished and not ((token_ids or fmt.logprobs) and d.new_token_ids):
                    continue  # tokens that do not complete a character yet (a token's logprob never waits)
                if d.finished:
                    finals[i] = d
                yield _sse(CompletionResponse(
                    id=rid, created=created, model=model,
                    choices=[CompletionChoice(index=i, **fmt.chunk(i, d.new_text, d.new_token_ids, d.logprobs,
                                                                   d.prompt_logprobs),
                                              finish_reason=d.finish_reason if d.finished else None,
                                              token_ids=list(d.new_token_ids) if token_ids else None)],
                    spec_decode=SpecDecodeInfo.combine([d.metrics]) if d.finished else None))
            if include_usage:
                done = list(finals.values())
                yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(prompt_tokens, done),
                                              spec_decode=SpecDecodeInfo.combine([d.metrics for d in done])))
            yield _DONE
        except EngineUnavailableError as e:
            yield format_sse_event(data_str=APIError(503, str(e)).response().body.decode())
        finally:
            self._abort_unfinished(streams)

    # -------------------------------------------------------------------------------------------- chat
    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[list[int], Any]:
        """The prompt ids and sampling parameters of a chat request (online or a batch line); 400s name the field."""
        self.check_model(req.model)
        ids = self.render_chat(req)
        requested = req.requested_max_tokens
        # Chat's default: the rest of the context.
        max_tokens = requested if requested is not None else max(1, self.engine.max_model_len - len(ids))
        copies = self.sampling_params(req, max_tokens)
        self.check_length([ids], requested, "messages")
        return ids, copies

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        ids, copies = await self.off_loop(self.prepare_chat, req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(rid, [ids] * len(copies), copies, "messages")
        if req.stream:
            return EventSourceResponse(self._chat_events(rid, streams, len(ids), req.include_usage))
        results = await self._collect_unless_gone(streams, raw)
        if results is None:
            return Response(status_code=499)
        texts = TokenTexts(self.tokenizer)
        return _json(ChatCompletionResponse(
            id=rid, model=self.config.served_model_name,
            choices=[ChatChoice(index=i, message=ChatResponseMessage(content=r.text), finish_reason=r.finish_reason,
                                logprobs=None if r.logprobs is None else chat_logprobs(texts, r.logprobs))
                     for i, r in enumerate(results)],
            usage=_usage(len(ids), results), spec_decode=SpecDecodeInfo.combine([r.metrics for r in results])))

    async def _chat_events(self, rid: str, streams: list[RequestStream], prompt_tokens: int,
                           include_usage: bool) -> AsyncIterator[bytes]:
        created, model = _now(), self.config.served_model_name
        texts = TokenTexts(self.tokenizer)

        def chunk(i: int, delta: DeltaMessage, finish: str | None = None, logprobs: Any = None,
                  **extra: Any) -> bytes:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=model, **extra, choices=[
                ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)]))

        try:
            for i in range(len(streams)):
                yield chunk(i, DeltaMessage(role="assistant", content=""))
            finals: dict[int, Any] = {}
            async for i, d in self._merged(streams):
                if d.new_text or d.finished or d.logprobs:
                    yield chunk(i, DeltaMessage(content=d.new_text or None), d.finish_reason if d.finished else None,
                                None if d.logprobs is None else chat_logprobs(texts, d.logprobs),
                                spec_decode=SpecDecodeInfo.combine([d.metrics]) if d.finished else None)
                if d.finished:
                    finals[i] = d
            if include_usage:
                done = list(finals.values())
                yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                               usage=_usage(prompt_tokens, done),
                                               spec_decode=SpecDecodeInfo.combine([d.metrics for d in done])))
            yield _DONE
        except EngineUnavailableError as e:
            yield format_sse_event(data_str=APIError(503, str(e)).response().body.decode())
        finally:
            self._abort_unfinished(streams)

    # ----------------------------------------------------------------------------------------- helpers
    async def _collect_unless_gone(self, streams: list[RequestStream], raw: Request) -> list[_Result] | None:
        """Every stream's whole output; None (and the requests aborted) if the client disconnects first."""
        work = asyncio.ensure_future(_collect_all(streams))
        watch = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                try:
                    return work.result()
                except EngineUnavailableError as e:
                    raise APIError(503, str(e)) from e
            return None
        finally:
            watch.cancel()
            work.cancel()
            self._abort_unfinished(streams)

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    @staticmethod
    async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, delta) from several streams as they arrive."""
        if len(streams) == 1:
            async for d in streams[0]:
                yield 0, d
            return
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    try:
                        d = fut.result()
                    except StopAsyncIteration:
                        continue
                    yield i, d
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
        finally:
            for fut in pending:
                fut.cancel()


@dataclass
class _Result:
    text: str
    num_output_tokens: int
    finish_reason: str | None
    metrics: dict | None
    token_ids: list[int]
    logprobs: list[Any] | None = None  # engine/core/outputs.py Logprob, one per token, when asked
    prompt_logprobs: list[Any] | None = None


async def _collect(stream: RequestStream) -> _Result:
    parts, ids, last, lps, prompt_lps = [], [], None, None, None
    async for d in stream:
        parts.append(d.new_text)
        ids += d.new_token_ids
        if d.logprobs is not None:
            lps = (lps or []) + d.logprobs
        prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
        last = d
    return _Result("".join(parts), last.num_output_tokens, last.finish_reason, last.metrics, ids, lps, prompt_lps)


async def _collect_all(streams: list[RequestStream]) -> list[_Result]:
    return list(await asyncio.gather(*[_collect(s) for s in streams]))


async def _wait_disconnect(raw: Request) -> None:
    # The body is read, so the next ASGI message is the disconnect (uvicorn sends it when the socket closes).
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, results: list[Any]) -> UsageInfo:
    completion = sum(r.num_output_tokens for r in results)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion)


def _json(obj: BaseModel) -> Response:
    return Response(obj.model_dump_json(), media_type="application/json")


def _sse(obj: BaseModel) -> bytes:
    return format_sse_event(data_str=obj.model_dump_json())


def _encode(tok: Any, text: str, field: str, **kw: Any) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in the JSON body) is not text a tokenizer takes
        raise APIError(400, f"{field}: not valid Unicode text ({e.reason} at character {e.start}); a lone "
                            "surrogate escape such as \\ud800 has no UTF-8 encoding", field) from None
    try:
        return tok.encode(text, **kw)
    except Exception as e:  # the tokenizer refuses this one text: a 400 for this request, never a 500
        raise APIError(400, f"{field}: the tokenizer refused it ({type(e).__name__}: {e})", field) from None
