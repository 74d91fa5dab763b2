"""The OpenAI wire formats the client reads and writes: completions, SSE chunks, batch input lines."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.client.errors import ServerError


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    raw: dict[str, Any]


def completion_of(body: dict[str, Any], chat: bool) -> Completion:
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Completion(text, choice.get("finish_reason"), body.get("usage"), body)


def batch_lines(requests: Iterable[dict[str, Any]], endpoint: str) -> Iterator[str]:
    """OpenAI batch lines from full lines ({"custom_id", "body", ...}) or bare bodies (custom_id = position)."""
    for i, r in enumerate(requests):
        if "body" in r:
            line = {"method": "POST", "url": endpoint, **r}
            line.setdefault("custom_id", str(i))
        else:
            line = {"custom_id": str(i), "method": "POST", "url": endpoint, "body": r}
        yield json.dumps(line) + "\n"


def spool(requests_or_path: str | os.PathLike[str] | Iterable[dict[str, Any]], endpoint: str) -> tuple[str, bool]:
    """A path to upload: the user's file as is, or the requests written to a temporary file (not memory)."""
    if isinstance(requests_or_path, (str, os.PathLike)):
        return os.fspath(requests_or_path), False
    fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="specserve-batch-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for line in batch_lines(requests_or_path, endpoint):
            f.write(line)
    return path, True


def sse_data(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise ServerError(503, obj["error"].get("message", data), obj)
            yield obj


def text_piece(chunk: dict[str, Any], chat: bool) -> str:
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    return (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
