"""Where a request stops (stop token ids: EOS unless ignore_eos; stop strings; max_tokens), and its text so far.

Stop strings are searched incrementally: a match must end inside the text a new token completed, so it
starts at most ``max(len(stop)) - 1`` characters before it; only that tail is scanned, O(output length) in
all. Streamed text lags the decoded text by the same number of characters, so text that may turn out to be
the start of a stop string is never sent (vLLM does the same).
"""

from __future__ import annotations

from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from workers.verification import truncate_at_stop


class StopChecker:
    def __init__(self, stop_token_ids: set[int], stop_strings: list[str], tokenizer: Any) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._hold = max((len(s) for s in stop_strings), default=1) - 1  # chars a stop string may still claim
        self._sent = 0  # chars of text already handed out by take_text
        self.stop_string_hit: str | None = None
        # A special stop token (EOS, a chat model's <|im_end|>) ends the request but is not text: its id stays in
        # the output's token ids and is left out of the text, as vLLM's skip_special_tokens does.
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        self._textless_stops = stop_token_ids & special

    @property
    def text(self) -> str | None:
        """The output's text so far (cut before a stop string that ended it); None without a tokenizer."""
        return None if self.detok is None else self.detok.text

    def truncate(self, new: list[int], remaining: int) -> tuple[list[int], bool]:
        """Tokens of ``new`` to keep, and whether a stop (token or string) ended the request. Decodes them."""
        kept, stopped = truncate_at_stop(new, self.stop_token_ids, remaining)
        detok = self.detok
        if detok is None:
            return kept, stopped
        for i, t in enumerate(kept):
            if stopped and i == len(kept) - 1 and t in self._textless_stops:
                break
            start = len(detok.text)
            if detok.append(t) and self.stop_strings and self._find_stop(start):
                return kept[: i + 1], True  # the token completing the stop string is kept, like vLLM
        return kept, stopped

    def _find_stop(self, start: int) -> bool:
        """Look for a stop string ending past ``start``; on a match, cut the text where it begins."""
        detok = self.detok
        lo = max(0, start - self._hold)
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            at = detok.text.find(s, lo)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        detok.text = detok.text[: best[0]]
        self.stop_string_hit = best[1]
        return True

    def take_text(self, finished: bool) -> str:
        """Text not handed out yet; until the request finishes, the last characters a stop string may still
        claim are held back."""
        if self.detok is None:
            return ""
        if finished and self.stop_string_hit is None:
            self.detok.flush()
        text = self.detok.text
        end = len(text) if finished else max(self._sent, len(text) - self._hold)
        out, self._sent = text[self._sent:end], end
        return out
