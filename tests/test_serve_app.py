"""The replicated app's rules that need no running Serve: the API-key rule at build time, what the router reads
of a request, and resumption of a request another replica began (engine/serve_replicas)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.serve_replicas.app import build_app
from engine.serve_replicas.replica import ResumableEngine
from engine.serve_replicas.router import route_request
from engine.serve_replicas.wire import ReplicaRequest
from scheduler.sampling_params import SamplingParams


def test_an_open_bind_needs_a_key_before_anything_starts(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key"):
        build_app({"host": "0.0.0.0"})
    build_app({"host": "0.0.0.0", "api_key": "k"})  # a key: allowed
    build_app({})  # loopback by default: no key needed


def test_the_router_costs_a_resumed_request_by_what_is_left():
    req = ReplicaRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0), output_token_ids=[7, 8])
    r = route_request(SimpleNamespace(args=[req]))
    assert list(r.prompt_token_ids) == [1, 2, 3, 7, 8] and r.max_tokens == 8 and r.cost == 13
    assert route_request(SimpleNamespace(args=[])) is None  # stats(), info(): no request to weigh


def test_a_resumed_request_enters_the_engine_with_its_tokens_so_far():
    calls = []
    engine = SimpleNamespace(add_request=lambda *a, **kw: calls.append((a, kw)), max_model_len=64)
    resume = {"r1": [5, 6]}
    wrapped = ResumableEngine(engine, resume)
    wrapped.add_request("r1", [1], "params", priority=1)
    wrapped.add_request("r2", [1], "params")
    assert calls == [(("r1", [1], "params"), {"priority": 1, "output_token_ids": [5, 6]}),
                     (("r2", [1], "params"), {})]
    assert resume == {} and wrapped.max_model_len == 64


def test_replica_counters_sum_into_one_engine_view_that_never_falls():
    from engine.serve_replicas.replica_metrics import sum_stats
    from engine.server.metrics import EngineStats

    a = EngineStats(num_running=2, kv_cache_usage=0.5, num_drafts=3, num_draft_tokens=12, num_accepted_tokens=7,
                    accepted_per_position=(3, 2), chosen_depths=(("4", 3),), prefix_cache_queries=100,
                    prefix_cache_hits=64)
    b = EngineStats(num_running=1, kv_cache_usage=0.1, num_drafts=1, num_draft_tokens=4, num_accepted_tokens=4,
                    accepted_per_position=(1, 1, 1, 1), chosen_depths=(("0", 5), ("4", 1)), prefix_cache_queries=10)
    s = sum_stats([a, b])
    assert (s.num_running, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 4, 16, 11)
    assert s.accepted_per_position == (4, 3, 1, 1) and dict(s.chosen_depths) == {"0": 5, "4": 4}
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (110, 64) and abs(s.kv_cache_usage - 0.3) < 1e-9
