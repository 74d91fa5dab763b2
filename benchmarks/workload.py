"""What a load test sends and when: the requests (a ``specserve generate`` JSONL file, or random token ids) and
their arrival times (a gamma process).

Arrivals: the gaps between requests are i.i.d. Gamma(shape=burstiness, scale=1 / (rate * burstiness)), so the
mean gap is 1 / rate whatever the burstiness, and the squared coefficient of variation of the gaps is
1 / burstiness. Burstiness 1 is a Poisson process; below 1 requests come in clumps, above 1 more evenly
(vLLM's ``--burstiness`` means the same). Rate ``inf`` sends every request at time 0.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

# Fields of the `specserve generate` line format that become fields of the OpenAI request body (the server's
# names: vLLM's extensions top_k, min_p, stop_token_ids, ignore_eos included).
BODY_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
               "ignore_eos")
LINE_FIELDS = ("id", "prompt", "prompt_token_ids") + BODY_FIELDS


@dataclass
class BenchRequest:
    request_id: str
    prompt: str | list[int]  # text, or token ids (the completions endpoint takes either)
    params: dict[str, Any] = field(default_factory=dict)  # body fields: max_tokens, temperature, ...

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) and not (
                isinstance(self.prompt, list) and self.prompt and all(type(t) is int for t in self.prompt)):
            raise ValueError(f"request {self.request_id}: prompt must be text or a non-empty list of token ids")
        unknown = sorted(set(self.params) - set(BODY_FIELDS))
        if unknown:
            raise ValueError(f"request {self.request_id}: unknown field(s) {unknown}; allowed: {list(BODY_FIELDS)}")


def load_jsonl(path: str, num_prompts: int, defaults: dict[str, Any] | None = None) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of a ``specserve generate`` input file, cycling through it when it
    has fewer lines. ``defaults`` fill body fields a line does not set (e.g. max_tokens, ignore_eos)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            unknown = sorted(set(obj) - set(LINE_FIELDS))
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown field(s) {unknown}; allowed: {list(LINE_FIELDS)}")
            if ("prompt" in obj) == ("prompt_token_ids" in obj):
                raise ValueError(f"{path}:{lineno}: exactly one of 'prompt' or 'prompt_token_ids' is required")
            rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no requests")
    out = []
    for i in range(num_prompts):
        row = rows[i % len(rows)]
        rid = str(row.get("id", i % len(rows)))
        if i >= len(rows):
            rid = f"{rid}#{i // len(rows)}"  # the same line sent again: keep ids unique
        params = {**(defaults or {}), **{k: row[k] for k in BODY_FIELDS if k in row}}
        prompt = row["prompt"] if "prompt" in row else row["prompt_token_ids"]
        out.append(BenchRequest(rid, prompt, params))
    return out


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    token_range: tuple[int, int] = (100, 1000), seed: int = 0,
                    defaults: dict[str, Any] | None = None) -> list[BenchRequest]:
    """Prompts of random token ids, lengths uniform in [len * (1 - r), len * (1 + r)] (as vLLM's random
    dataset). ``max_tokens`` is the drawn output length; pair with ``ignore_eos`` to get exactly that many."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, random input and output lengths must all be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"random token range must satisfy 0 <= min < max, got {token_range}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return rng.randint(max(1, math.floor(n * (1 - range_ratio))), max(1, math.ceil(n * (1 + range_ratio))))

    out = []
    for i in range(num_prompts):
        n_in, n_out = draw(input_len), draw(output_len)
        ids = [rng.randrange(lo, hi) for _ in range(n_in)]
        out.append(BenchRequest(f"random-{i}", ids, {**(defaults or {}), "max_tokens": n_out}))
    return out


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, token_range: tuple[int, int] = (100, 1000), seed: int = 0,
                               defaults: dict[str, Any] | None = None) -> list[BenchRequest]:
    """Shared-prefix prompts (vLLM's ``prefix_repetition`` dataset): ``num_prefixes`` random prefixes of
    ``prefix_len`` token ids, each request one of them (in turn, then shuffled) followed by its own random suffix
    of ``suffix_len``; ``max_tokens`` = ``output_len``. What a prefix cache is for: a system prompt or documents
    sent again and again."""
    if min(num_prompts, prefix_len, num_prefixes, output_len) < 1 or suffix_len < 0:
        raise ValueError("num_prompts, prefix length, number of prefixes and output length must be >= 1, "
                         "suffix length >= 0")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"random token range must satisfy 0 <= min < max, got {token_range}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = [BenchRequest(f"prefix{i % num_prefixes}-{i}",
                        prefixes[i % num_prefixes] + [rng.randrange(lo, hi) for _ in range(suffix_len)],
                        {**(defaults or {}), "max_tokens": output_len})
           for i in range(num_prompts)]
    rng.shuffle(out)
    return out


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start, for ``n`` requests: the first at 0, then gamma-distributed gaps
    with mean 1 / request_rate and squared coefficient of variation 1 / burstiness."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out
