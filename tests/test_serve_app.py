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
