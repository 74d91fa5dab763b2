"""OpenAI's logprobs shapes (and ``echo``) from the engine's ``Logprob`` values (engine/core/outputs.py).

Completions (legacy shape): parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``;
under ``echo`` the prompt's tokens come first, the first of them with ``None`` (nothing scores it), which is what
lm-evaluation-harness slices (``token_logprobs[ctxlen:-1]``). Chat: ``{"content": [{token, logprob, bytes,
top_logprobs: [...]}]}``. Streamed, each chunk carries its own tokens' entries and the offsets keep counting
from the choice's text so far. JSON has no -inf: a token the processed law cuts is -9999.0, as in OpenAI's and
vLLM's answers. Without a tokenizer a token is spelled ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.core.outputs import Logprob
from engine.server.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

CUT = -9999.0  # what a -inf logprob is sent as


def _value(x: float) -> float:
    return x if math.isfinite(x) else CUT


class TokenTexts:
    """Each token's own text (decoded alone: a piece of a character reads as U+FFFD, as in OpenAI's answers)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text

    def prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(prompt, skip_special_tokens=False)


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], entries: Sequence[Logprob | None],
                        offset: int = 0) -> CompletionLogprobs:
    """One entry per token of ``token_ids`` (an entry None: the prompt's first token); offsets from ``offset``."""
    out = CompletionLogprobs()
    for t, e in zip(token_ids, entries, strict=True):
        text = texts(t)
        out.tokens.append(text)
        out.token_logprobs.append(None if e is None else _value(e.logprob))
        out.top_logprobs.append(None if e is None else {texts(i): _value(v) for i, v in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(texts: TokenTexts, entries: Sequence[Logprob]) -> ChatLogprobs:
    def top(i: int, v: float) -> ChatTopLogprob:
        s = texts(i)
        return ChatTopLogprob(token=s, logprob=_value(v), bytes=list(s.encode("utf-8")))

    return ChatLogprobs(content=[ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                                                  top_logprobs=[top(i, v) for i, v in e.top]) for e in entries])


class CompletionFormat:
    """Per choice of one completions request: the echoed prompt and the logprobs, whole or chunk by chunk."""

    def __init__(self, texts: TokenTexts, prompts: Sequence[str | list[int]], prompt_ids: Sequence[list[int]],
                 echo: bool, logprobs: bool) -> None:
        self.texts, self.prompts, self.prompt_ids = texts, prompts, prompt_ids
        self.echo, self.logprobs = echo, logprobs
        self._offsets = [0] * len(prompts)  # streamed: the choice's text length so far
        self._echoed = [False] * len(prompts)

    def whole(self, i: int, text: str, token_ids: list[int], logprobs: list[Logprob] | None,
              prompt_logprobs: list[Logprob | None] | None) -> dict[str, Any]:
        """The ``text`` and ``logprobs`` fields of choice i's whole answer."""
        return self._fields(i, text, token_ids, logprobs, prompt_logprobs)

    def chunk(self, i: int, text: str, token_ids: list[int], logprobs: list[Logprob] | None,
              prompt_logprobs: list[Logprob | None] | None) -> dict[str, Any]:
        """The same for one streamed delta: the prompt rides on the choice's first chunk."""
        first = not self._echoed[i]
        self._echoed[i] = True
        fields = self._fields(i, text, token_ids, logprobs, prompt_logprobs if first else None, echo=first)
        self._offsets[i] += len(fields["text"])
        return fields

    def _fields(self, i: int, text: str, token_ids: list[int], logprobs: list[Logprob] | None,
                prompt_logprobs: list[Logprob | None] | None, echo: bool = True) -> dict[str, Any]:
        prefix = self.texts.prompt_text(self.prompts[i]) if self.echo and echo else ""
        if not self.logprobs:
            return {"text": prefix + text, "logprobs": None}
        ids: list[int] = []
        entries: list[Logprob | None] = []
        if prefix and prompt_logprobs is not None:
            ids += self.prompt_ids[i]
            entries += prompt_logprobs
        ids += token_ids
        entries += logprobs or []
        return {"text": prefix + text, "logprobs": completion_logprobs(self.texts, ids, entries, self._offsets[i])}
