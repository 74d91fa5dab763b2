"""Incremental detokenization: the text of a growing token sequence, a few tokens of decoding per new token.

Decoding one token at a time is wrong for byte-level BPE (one character may span several tokens, and a lone
continuation byte decodes to U+FFFD) and for tokenizers whose decode of a token depends on its neighbours
(SentencePiece's leading space). Re-decoding the whole output every token is right but quadratic. So, as in
TGI and vLLM, we decode a short window: ``ids[prefix_offset:]`` minus its already-read part
``ids[prefix_offset:read_offset]``, and advance only when the window ends on a complete character.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"  # what decode gives for a byte sequence cut inside a UTF-8 character


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far: complete characters only, until flush()
        self._prefix_offset = 0  # window start: context the new tokens are decoded against
        self._read_offset = 0  # tokens before this are already part of ``text``

    def _window(self) -> tuple[str, str]:
        ids = self.token_ids
        return (self.tokenizer.decode(ids[self._prefix_offset:self._read_offset]),
                self.tokenizer.decode(ids[self._prefix_offset:]))

    def append(self, token_id: int) -> str:
        """Adds one token; returns the text it completed ("" when held back for the next tokens)."""
        self.token_ids.append(token_id)
        prefix_text, full = self._window()
        if len(full) <= len(prefix_text) or full.endswith(_INCOMPLETE):
            return ""
        new = full[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the output: what the held-back tokens decode to, incomplete characters included."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text, full = self._window()
        new = full[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += new
        return new
