"""Where a request stops: stop token ids (EOS unless ignore_eos), stop strings, and max_tokens."""

from __future__ import annotations

from workers.verification import truncate_at_stop


class StopChecker:
    def __init__(self, stop_token_ids: set[int], stop_strings: list[str], tokenizer) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.tokenizer = tokenizer
        self.stop_string_hit: str | None = None

    def truncate(self, prev: list[int], new: list[int], remaining: int) -> tuple[list[int], bool]:
        """Tokens of ``new`` to keep, and whether a stop (token or string) ended the request."""
        kept, stopped = truncate_at_stop(new, self.stop_token_ids, remaining)
        if not self.stop_strings:
            return kept, stopped
        # A stop string may complete at any of the new tokens: find the first one that completes it.
        before = self.tokenizer.decode(prev)
        for i in range(1, len(kept) + 1):
            text = self.tokenizer.decode(prev + kept[:i])
            for s in self.stop_strings:
                # Only a match reaching past the old text is new (an old match would have stopped earlier).
                at = text.find(s, max(0, len(before) - len(s) + 1))
                if at >= 0:
                    self.stop_string_hit = s
                    return kept[:i], True
        return kept, stopped

    def final_text(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids)
        if self.stop_string_hit is not None:
            text = text[: text.find(self.stop_string_hit)]
        return text
