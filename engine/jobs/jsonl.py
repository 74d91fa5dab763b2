"""Reading JSONL the way batch jobs need it: streamed, split on "\\n" only, one line's problem kept to that line.

``str.splitlines()`` also splits at U+2028, U+0085, \\r, \\f ... which are legal inside a JSON string, so a
valid line would break in two; binary iteration over the file splits on b"\\n" only. Each line is decoded on its
own: a line that is not UTF-8 is an error for that line, not for the file. A UTF-8 BOM at the start is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

BOM = b"\xef\xbb\xbf"


@dataclass
class JsonlLine:
    number: int  # 1-based line number in the file (blank lines count)
    text: str | None  # None when the bytes are not UTF-8
    error: str | None = None
    offset: int = 0  # byte offset of the line in the file (BOM and terminator excluded)
    length: int = 0  # bytes of the line (terminator excluded)

    @property
    def blank(self) -> bool:
        return self.text is not None and not self.text.strip()


def iter_lines(f: IO[bytes]) -> Iterator[JsonlLine]:
    """Every line of a binary file, decoded one at a time (memory: one line)."""
    pos = 0
    for number, raw in enumerate(f, start=1):
        start, pos = pos, pos + len(raw)
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
            start += len(BOM)
        raw = raw.removesuffix(b"\n").removesuffix(b"\r")
        try:
            yield JsonlLine(number, raw.decode("utf-8"), None, start, len(raw))
        except UnicodeDecodeError as e:
            yield JsonlLine(number, None, f"line {number}: not valid UTF-8 ({e.reason} at byte {e.start})", start,
                            len(raw))


def loads(text: str) -> Any:
    """json.loads, with nesting too deep for the parser reported as a ValueError like any malformed line."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def count_lines(path: str) -> int:
    """Non-blank lines, counted by streaming the file (for a progress bar's total)."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
    return n
