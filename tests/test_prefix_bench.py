"""`bench serve`'s shared-prefix workload (vLLM's prefix_repetition dataset) and its prefix-cache report."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.serve import add_workload_args, build_requests
from benchmarks.serve_report import format_summary
from benchmarks.server_metrics import parse_metrics, prefix_cache_delta
from benchmarks.workload import prefix_repetition_requests


def test_prefix_repetition_prompts_share_their_prefixes() -> None:
    reqs = prefix_repetition_requests(40, prefix_len=30, suffix_len=5, num_prefixes=4, output_len=7, seed=3)
    assert len(reqs) == 40 and all(len(r.prompt) == 35 and r.params["max_tokens"] == 7 for r in reqs)
    prefixes = {tuple(r.prompt[:30]) for r in reqs}
    assert len(prefixes) == 4
    for p in prefixes:
        assert sum(tuple(r.prompt[:30]) == p for r in reqs) == 10
    assert len({tuple(r.prompt) for r in reqs}) == 40  # suffixes differ
    assert [r.request_id for r in reqs] != sorted(r.request_id for r in reqs)  # shuffled
    again = prefix_repetition_requests(40, prefix_len=30, suffix_len=5, num_prefixes=4, output_len=7, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    with pytest.raises(ValueError):
        prefix_repetition_requests(4, prefix_len=0, suffix_len=5, num_prefixes=1, output_len=7)


def test_cli_flags_build_the_workload() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    args = ap.parse_args(["--prefix-repetition-prefix-len", "50", "--prefix-repetition-suffix-len", "3",
                          "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "9",
                          "--ignore-eos"])
    reqs = build_requests(args, 6)
    assert len({tuple(r.prompt[:50]) for r in reqs}) == 2 and all(len(r.prompt) == 53 for r in reqs)
    assert all(r.params == {"ignore_eos": True, "max_tokens": 9} for r in reqs)
    with pytest.raises(ValueError, match="one of"):
        build_requests(ap.parse_args(["--prefix-repetition-prefix-len", "5", "--random-input-len", "5"]), 2)


def test_prefix_cache_section_is_the_counter_difference() -> None:
    def snap(q: float, h: float):
        return parse_metrics(f'specserve:prefix_cache_queries_total{{model_name="m"}} {q}\n'
                             f'specserve:prefix_cache_hits_total{{model_name="m"}} {h}\n')

    delta = prefix_cache_delta(snap(100, 10), snap(400, 250))
    assert delta == {"queries": 300, "hits": 240, "hit_rate": 0.8}
    assert prefix_cache_delta(snap(1, 1), parse_metrics("")) is None
    text = format_summary({"prefix_cache": delta, **_empty_result()}, [50.0, 99.0])
    assert "Prefix cache hit rate (tokens):" in text and "0.800" in text


def _empty_result() -> dict:
    from benchmarks.serve_report import summarize

    return summarize([], 1.0, [50.0, 99.0], {})
