"""What the engine hands back: a delta per request per step (streaming), and a whole output (batch callers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at its position and the position's k most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; empty when k = 0


@dataclass
class RequestDelta:
    """What one step added to one request: its new tokens and text, and how it ended when it did.

    The concatenation of a request's ``new_token_ids`` is its output, and of its ``new_text`` its final text.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str  # "" when nothing new is decodable yet, or the model has no tokenizer
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    metrics: dict | None  # the request's stats dict (rounds, accepted tokens, ttft...) when finished, else None
    logprobs: list[Logprob] | None = None  # one per new token, when the request asked (SamplingParams.logprobs)
    # The prompt's, position 0 None (nothing scores the first token): on the request's first delta, when asked.
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class RequestOutput:
    """A finished request, whole (``LLM.generate``, ``specserve generate``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the model has no tokenizer
    finish_reason: str | None
    finished: bool
    metrics: dict
    logprobs: list[Logprob] | None = None  # one per output token, when asked
    prompt_logprobs: list[Logprob | None] | None = None
