"""Requests for the adaptive policy's unit tests: mid-decode, long-running, each with one output token committed."""

from __future__ import annotations

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams


def decoding_requests(n: int, greedy: bool = True) -> list[Request]:
    """``n`` requests of a 16-token prompt and one output token, target and draft caches caught up to the last."""
    reqs = []
    for i in range(n):
        r = Request(i, str(i), [1] * 16, SamplingParams(max_tokens=10_000, temperature=0.0 if greedy else 1.0,
                                                         ignore_eos=True))
        r.output_token_ids = [2]
        r.num_cached_target = r.num_cached_draft = r.num_tokens - 1
        reqs.append(r)
    return reqs
