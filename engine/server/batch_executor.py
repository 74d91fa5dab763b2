"""Runs one batch line the way the online routes run a request: same validation, same response objects.

A batch body goes through the same pydantic models (``CompletionRequest`` / ``ChatCompletionRequest``), the
same checks (model name, prompt length, sampling bounds) and the same response classes as
``/v1/completions`` and ``/v1/chat/completions``, so a batch result is byte for byte what the online endpoint
would have answered; it only enters the engine at batch priority (below online traffic). A 4xx becomes the
line's error-file row; 429 / 503 (queue full, engine down) ask the runner to try the line again later.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from pydantic import ValidationError

from engine.jobs.runner import BATCH_PRIORITY, RetryLater
from engine.server.app import validation_message
from engine.server.async_engine import EngineUnavailableError, RequestStream
from engine.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SpecDecodeInfo,
    UsageInfo,
)
from engine.server.serving import APIError, Serving


class ServingExecutor:
    def __init__(self, serving: Serving, priority: int = BATCH_PRIORITY) -> None:
        self.serving = serving
        self.priority = priority

    async def execute(self, endpoint: str, body: dict[str, Any], request_id: str) -> tuple[int, dict[str, Any]]:
        try:
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"body: not valid Unicode text ({e.reason}); a lone surrogate escape such as "
                                    "\\ud800 cannot be tokenized") from None
            if endpoint == "/v1/completions":
                return 200, await self._completion(CompletionRequest.model_validate(body), request_id)
            return 200, await self._chat(ChatCompletionRequest.model_validate(body), request_id)
        except ValidationError as e:
            message, param = validation_message(list(e.errors()))
            return 400, APIError(400, message, param).body()
        except APIError as e:
            if e.status in (429, 503):
                raise RetryLater(e.message) from e
            return e.status, e.body()
        except EngineUnavailableError as e:  # the engine died mid-request: pending, it runs after a restart
            raise RetryLater(str(e)) from e

    async def _completion(self, req: CompletionRequest, request_id: str) -> dict[str, Any]:
        s = self.serving
        _no_stream(req)
        s.check_model(req.model)
        prompts = await s.encode_all(req.prompts())
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        (params,) = s.sampling_params(req, max_tokens)  # n is 1 here (_no_stream)
        s.check_length(prompts, max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        results = await self._run(rid, prompts, params, "prompt")
        return CompletionResponse(
            id=rid, model=s.config.served_model_name,
            choices=[CompletionChoice(index=i, text=r[0], finish_reason=r[2]) for i, r in enumerate(results)],
            usage=_usage(sum(len(p) for p in prompts), results),
            spec_decode=SpecDecodeInfo.combine([r[3] for r in results])).model_dump(mode="json")

    async def _chat(self, req: ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        s = self.serving
        _no_stream(req)
        ids, (params,) = await s.off_loop(s.prepare_chat, req)  # n is 1 here (_no_stream)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        (r,) = await self._run(rid, [ids], params, "messages")
        return ChatCompletionResponse(
            id=rid, model=s.config.served_model_name,
            choices=[ChatChoice(index=0, message=ChatResponseMessage(content=r[0]), finish_reason=r[2])],
            usage=_usage(len(ids), [r]), spec_decode=SpecDecodeInfo.combine([r[3]])).model_dump(mode="json")

    async def _run(self, rid: str, prompts: list[list[int]], params: Any, field: str) -> list[tuple]:
        streams = await self.serving.submit(rid, prompts, [params] * len(prompts), field, priority=self.priority)
        try:
            return list(await asyncio.gather(*[_collect(st) for st in streams]))
        finally:  # cancelled (the batch was cancelled, the server stops): free the engine's slots
            for st in streams:
                if not st.finished:
                    self.serving.engine.abort(st.request_id)


def _no_stream(req: Any) -> None:
    if req.stream:
        raise APIError(400, "stream: not supported in a batch (results are written to the output file)", "stream")
    if any(v is not None for v in req.logprob_fields().values()) or getattr(req, "echo", None):
        raise APIError(400, "logprobs: not supported in a batch yet (nor echo); send it online", "logprobs")
    if req.n not in (None, 1):
        raise APIError(400, "n: only n=1 in a batch for now (one result line per request); send it online", "n")


async def _collect(stream: RequestStream) -> tuple[str, int, str | None, dict | None]:
    """(text, output tokens, finish reason, metrics) of one finished stream."""
    parts, last = [], None
    async for d in stream:
        parts.append(d.new_text)
        last = d
    return "".join(parts), last.num_output_tokens, last.finish_reason, last.metrics


def _usage(prompt_tokens: int, results: list[tuple]) -> UsageInfo:
    completion = sum(r[1] for r in results)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
