"""OpenAI request and response bodies as pydantic models, with OpenAI's field names.

Requests are strict (no "1" for 1, no unknown fields): a body that does not match is a 400 naming the field.
Fields OpenAI defines that specserve does not implement (best_of > n, logit_bias, penalties, tools, ...) are
accepted only at their "off" value and otherwise refused with a 400 that says so — never ignored.
Value ranges (temperature >= 0, top_p in (0, 1], ...) are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

from scheduler.sampling_params import MAX_LOGPROBS, SamplingParams

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the engine's seeds are 64-bit, as in vLLM
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat defaults to the rest of the context)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _is_off(name: str, value: Any) -> bool:
    """Whether an unsupported OpenAI field holds its neutral value (so sending it changes nothing)."""
    if value is None:
        return True
    if name == "best_of":
        return type(value) is int and value == 1
    if name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        return type(value) in (int, float) and value == (1 if name == "repetition_penalty" else 0)
    if name in ("logit_bias", "tools", "functions"):
        return value == {} or value == []
    if name in ("echo", "logprobs", "parallel_tool_calls"):
        return value is False
    if name == "top_logprobs":
        return type(value) is int and value == 0
    if name in ("tool_choice", "function_call"):
        return value == "none"
    return False  # suffix, and anything else: any value asks for a feature we lack


def _refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    if not _is_off(info.field_name, value):
        raise ValueError(f"{info.field_name} is not supported by specserve")
    return value


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata for the caller's own bookkeeping; it changes nothing
    # vLLM's extensions
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs_mode: str | None = None  # vLLM's names (SamplingParams.logprobs_mode): which values logprobs carry
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    n: int | None = Field(None, ge=1)  # choices per prompt: independent samples (the server's max_n bounds it)
    # OpenAI fields specserve does not implement: only their neutral value is accepted
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None

    @field_validator("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(v, info)

    def sampling_params(self, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field and its limit (SamplingParams is the one place ranges live);
        ``vocab_size`` bounds top_k (the message then names the vocabulary, not the int32 limit)."""
        kw: dict[str, Any] = {"max_tokens": max_tokens}
        for name in ("temperature", "top_p", "min_p", "seed"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if self.logprobs_mode is not None:
            kw["logprobs_mode"] = self.logprobs_mode
        kw["structured_outputs"] = self.structured()
        params = SamplingParams(**kw, **self.logprob_fields(), ignore_eos=self.ignore_eos)
        if self.top_k is not None:  # 0 and -1: off (read as -1, as vLLM and Hugging Face do)
            params.top_k = -1 if self.top_k == 0 else self.top_k
            params.validate(vocab_size)
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprob_fields(self) -> dict[str, Any]:
        """SamplingParams' logprobs / prompt_logprobs from the request's own fields (a subclass's spelling)."""
        return {}

    def structured(self) -> dict[str, Any] | None:
        """SamplingParams.structured_outputs from whichever field asks (at most one may)."""
        rf = self.response_format
        given = {
            "response_format": None if rf is None or rf.get("type") == "text" else _from_response_format(rf),
            "structured_outputs": self.structured_outputs,
            "guided_json": None if self.guided_json is None else {"json": self.guided_json},
            "guided_regex": None if self.guided_regex is None else {"regex": self.guided_regex},
            "guided_choice": None if self.guided_choice is None else {"choice": self.guided_choice},
            "guided_grammar": None if self.guided_grammar is None else {"grammar": self.guided_grammar},
        }
        asked = [k for k, v in given.items() if v is not None]
        if len(asked) > 1:
            raise ValueError(f"{asked[1]}: only one of {', '.join(asked)} may be given")
        return given[asked[0]] if asked else None


def _from_response_format(rf: dict[str, Any]) -> dict[str, Any]:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ValueError("response_format: json_schema must be an object with a 'schema' object")
        return {"json": js.get("schema", {})}  # OpenAI: an absent schema means any JSON
    raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")


def _check_k(name: str, k: int | None) -> int | None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"must be between 0 and {MAX_LOGPROBS} (the most alternatives per token), got {k}")
    return k


class CompletionRequest(_SamplingRequest):
    # text, a batch of texts, token ids, or a batch of token-id lists
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # k: each token's logprob and its k most likely alternatives (<= 20)
    echo: bool | None = None  # the prompt's text (and, with logprobs, its tokens' logprobs) before the completion
    best_of: Any = None
    suffix: Any = None
    # vLLM's: each choice (each streamed chunk) also carries its output token ids. None: only where the model has
    # no tokenizer, whose text is always empty (without them its streams carried nothing until the end, and a
    # load test measured no time to first token).
    return_token_ids: bool | None = None

    @field_validator("suffix")
    @classmethod
    def _unsupported_completion(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(v, info)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or (type(v) is int and v == (info.data.get("n") or 1)):
            return v  # best_of == n: every sample is returned, nothing is chosen
        raise ValueError("best_of > n is not supported by specserve (it would rank samples on the server); ask "
                         "for n samples with logprobs and choose on the client")

    @field_validator("logprobs")
    @classmethod
    def _k(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_k(info.field_name, v)

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("must contain at least one prompt, and each token-id prompt at least one token")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None  # k alternatives per token (<= 20); needs logprobs: true
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
    @classmethod
    def _unsupported_chat(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(v, info)

    @field_validator("top_logprobs")
    @classmethod
    def _k(cls, v: int | None, info: ValidationInfo) -> int | None:
        if _check_k(info.field_name, v) and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true (OpenAI's rule)")
        return v

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------------------------------------- responses

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SpecDecodeInfo(BaseModel):
    """specserve's extension: how speculation went for this request (summed over prompts of a batch)."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0  # tokens per verify round, bonus/recovered included (vLLM's convention)

    @classmethod
    def combine(cls, metrics: list[dict | None]) -> SpecDecodeInfo:
        rounds = drafted = accepted = 0
        emitted = 0.0
        for m in metrics:
            if not m:
                continue
            r = int(m.get("rounds", 0))
            rounds += r
            drafted += int(m.get("drafted_tokens", 0))
            accepted += int(m.get("accepted_tokens", 0))
            emitted += float(m.get("mean_acceptance_length", 0.0)) * r
        return cls(rounds=rounds, drafted_tokens=drafted, accepted_tokens=accepted,
                   mean_acceptance_length=round(emitted / rounds, 4) if rounds else 0.0)


def _now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token (the prompt's first under echo)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # each token's start in the choice's text


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may be part of a character)


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # only when asked for (``return_token_ids``)

    @model_serializer(mode="wrap")
    def _ids_when_set(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("token_ids") is None:
            out.pop("token_ids", None)
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    spec_decode: SpecDecodeInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
