"""The two kinds of worker group: the target (verifies) and the draft (proposes).

A ``str`` enum: a role compares equal to, hashes like and prints as its plain string, so messages, logs,
Prometheus labels, JSON and msgpack frames carry the same "target" / "draft" they always did, and code that
still spells the string keeps working.
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    TARGET = "target"
    DRAFT = "draft"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
