"""Per-request sampling settings, validated where they enter (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature a request is greedy, everywhere (engine, draft and target workers; vLLM uses the same
# epsilon): dividing logits by a tiny T only makes a one-hot with rounding noise, so we take the argmax instead.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_TEMPERATURE


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = -1  # -1 = off, else >= 1
    min_p: float = 0.0  # [0, 1]; 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def _check_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")


def _check_float(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
