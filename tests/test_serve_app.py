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


class FakeReplicas:
    """A deployment handle whose replicas are scripted: each call plays the next script (a list of items; an
    exception item is raised there, as a dying replica's stream does)."""

    def __init__(self, scripts):
        self.scripts, self.calls = list(scripts), []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **kw):
        return self

    def _remote(self, req):
        self.calls.append((list(req.prompt_token_ids), list(req.output_token_ids)))
        script = self.scripts.pop(0)

        async def gen():
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        return gen()


def _delta(tokens, n, finished=False):
    from engine.core.outputs import RequestDelta

    return RequestDelta("r", tokens, "".join(f"<{t}>" for t in tokens), finished, "length" if finished else None,
                        2, n, None)


def test_a_stream_broken_off_by_a_dying_replica_resumes_elsewhere_from_its_tokens_so_far():
    import asyncio

    from engine.serve_replicas.routed_engine import RoutedEngine
    from engine.serve_replicas.wire import Accepted, ReplicaError

    handle = FakeReplicas([
        [Accepted("a"), _delta([5], 1), _delta([6, 7], 3), RuntimeError("ActorDiedError: replica a")],
        [ReplicaError("unavailable", "engine restarting")],  # the next replica's engine is down: try again
        [Accepted("b"), _delta([8], 4), _delta([9], 5, finished=True)],
    ])
    info = {"max_model_len": 64, "max_num_seqs": 4, "vocab_size": 100, "max_queue": 4}

    async def run():
        engine = RoutedEngine(handle, info, max_in_flight=8, retry_backoff_s=0.0)
        stream = await engine.add_request("r", [1, 2], SamplingParams(max_tokens=5, temperature=0))
        return [d async for d in stream]

    deltas = asyncio.run(asyncio.wait_for(run(), 10))
    assert [t for d in deltas for t in d.new_token_ids] == [5, 6, 7, 8, 9]  # no token repeated or lost
    assert "".join(d.new_text for d in deltas) == "<5><6><7><8><9>" and deltas[-1].finished
    assert handle.calls == [([1, 2], []), ([1, 2], [5, 6, 7]), ([1, 2], [5, 6, 7])]  # resumed after 5, 6, 7


def test_a_refusal_reaches_the_client_and_is_not_retried():
    import asyncio

    from engine.serve_replicas.routed_engine import RoutedEngine
    from engine.serve_replicas.wire import ReplicaError

    handle = FakeReplicas([[ReplicaError("invalid", "prompt: too long")]])
    info = {"max_model_len": 64, "max_num_seqs": 4, "vocab_size": 100, "max_queue": 4}

    async def run():
        engine = RoutedEngine(handle, info, max_in_flight=8, retry_backoff_s=0.0)
        await engine.add_request("r", [1, 2], SamplingParams(max_tokens=5))

    with pytest.raises(ValueError, match="too long"):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert len(handle.calls) == 1
