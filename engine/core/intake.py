"""A request's input checked before it is queued: its prompt as token ids, and a resumed request's output."""

from __future__ import annotations

from typing import Any

from engine.core.stopping import StopChecker
from scheduler.request import Request


def prompt_token_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt's token ids; ValueError naming the field when it has none or any outside the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send prompt_token_ids instead")
        token_ids = _encode(tokenizer, prompt)
    else:
        token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt: must contain at least one token")
    bad = out_of_vocab(token_ids, vocab_size)
    if bad:
        raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return token_ids


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"), e.g. from a JSON escape
        raise ValueError(f"prompt: not valid Unicode text ({e.reason} at character {e.start})") from None
    try:
        return list(tokenizer.encode(prompt))
    except Exception as e:  # the tokenizer refuses this one prompt; the engine and its batch are fine
        raise ValueError(f"prompt: the tokenizer refused it ({type(e).__name__}: {e})") from None


def out_of_vocab(token_ids: list, vocab_size: int) -> list:
    """The entries that are not token ids of this vocabulary (bools and non-integers included)."""
    return [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]


def resume(req: Request, checker: StopChecker, output: list[int], vocab_size: int, max_model_len: int) -> None:
    """Give a new request the output an earlier engine produced: it is re-prefilled with prompt + output (like
    a preempted request) and its detokenizer replays the output, so the text it sends next is exactly what
    follows the text already sent (nothing repeated, stop strings still found across the seam)."""
    out = list(output)
    if out_of_vocab(out, vocab_size):
        raise ValueError(f"output_token_ids: outside the vocabulary [0, {vocab_size})")
    if len(out) >= req.params.max_tokens or len(req.prompt_token_ids) + len(out) >= max_model_len:
        raise ValueError(f"output_token_ids: {len(out)} tokens already reach the request's limit "
                         f"(max_tokens={req.params.max_tokens}, context {max_model_len})")
    checker.truncate(out, len(out))  # replays the detokenizer; these tokens did not stop the request before
    checker.take_text(False)  # what the earlier engine already handed out
    req.output_token_ids = out
    req.stats.first_token_time = req.stats.arrival_time
