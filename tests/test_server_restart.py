"""The server through engine faults: ``/health`` degraded while a worker is restored, a failed engine rebuilt
with its open requests re-admitted (streams continue, nothing repeated), a bounded number of rebuilds, and
running Batch API jobs finishing with every line exactly once.

The fake engine (tests/helpers_server.py) covers the front end in seconds; one test runs the built-in pair in
process, with a fatal error injected into a step while streams and a batch job are in flight, and compares
every output with a run without the fault.
"""

from __future__ import annotations

import io
import json
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.execution.faults import TooManyRestartsError
from tests.helpers_server import (
    FakeEngine,
    FakeTokenizer,
    HealthPoller,
    ThreadServer,
    fake_stats,
    metric_value,
    wait_until,
)

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ResumableEngine(FakeEngine):
    """The fake engine, also taking ``LLMEngine.add_request``'s priority and resume arguments."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.added: list[tuple[str, int, int]] = []  # (request id, priority, tokens resumed from)

    def add_request(self, request_id: str, prompt, params, priority: int = 0,
                    output_token_ids: list[int] | None = None) -> None:
        super().add_request(request_id, prompt, params)
        self.waiting[-1].out = list(output_token_ids or [])  # the fake's n-th token is LETTERS[n]: resumable
        self.added.append((request_id, priority, len(output_token_ids or [])))


def _server(factory, engine=None, *, max_engine_restarts: int = 3, restart_backoff_s: float = 0.01, **kw):
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig

    ae = AsyncEngine(engine if engine is not None else factory(), max_queue=16, metrics=ServerMetrics("fake"),
                     stats_reader=fake_stats, engine_factory=factory, max_engine_restarts=max_engine_restarts,
                     restart_backoff_s=restart_backoff_s, **kw)
    return ThreadServer(build_app(ae, ServerConfig("fake"), FakeTokenizer())), ae


def _stream(url: str, body: dict, timeout_s: float = 60.0) -> list[str]:
    """The data fields of a streamed completion's events."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        return [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]


def _text(events: list[str]) -> str:
    assert events[-1] == "[DONE]", events[-3:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


def test_a_failed_engine_is_rebuilt_and_its_streams_continue_without_repeating() -> None:
    built: list[ResumableEngine] = []
    armed, fired = threading.Event(), threading.Event()

    def factory() -> ResumableEngine:
        if built:
            time.sleep(0.3)  # a rebuild takes a while (a model loads): /health must say so meanwhile
        e = ResumableEngine(step_s=0.01)
        if not built:  # the fault hook: once armed, the first engine's next step fails
            step = e.step

            def faulty_step():
                if armed.is_set() and not fired.is_set():
                    fired.set()
                    raise RuntimeError("worker died")
                return step()

            e.step = faulty_step
        built.append(e)
        return e

    srv, ae = _server(factory)
    health = HealthPoller(srv.url)
    try:
        wait_until(lambda: health.seen, 10, what="the first /health answer")  # before the fault
        out: dict[int, list[str]] = {}
        started = [threading.Event() for _ in range(2)]

        def run(i: int) -> None:
            body = {"prompt": "x", "max_tokens": 24 + i, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                events = []
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[len("data: "):])
                        started[i].set()
                out[i] = events

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: all(e.is_set() for e in started), 30, what="both streams under way")
        armed.set()
        for t in threads:
            t.join(60)
        assert fired.is_set()
        # The first letters came from the first engine, the rest from the second: once each, in order.
        assert [_text(out[i]) for i in range(2)] == [LETTERS[:24], LETTERS[:25]]
        assert len(built) == 2 and built[0].shut_down and not built[1].shut_down
        resumed = [n for _, _, n in built[1].added]
        assert len(resumed) == 2 and all(n > 0 for n in resumed)  # re-admitted from their tokens so far
        wait_until(lambda: health.seen[-1] == (200, "ok"), 10, what="/health ok again")
        seen = health.stop()
        assert (503, "restarting") in seen and seen[0] == (200, "ok") and seen[-1] == (200, "ok"), seen
        assert ae.engine_restarts == 1
        m = httpx.get(srv.url + "/metrics").text
        assert metric_value(m, "specserve:engine_restarts_total", {"model_name": "fake"}) == 1
    finally:
        health.stop()
        srv.stop()


def test_a_request_admitted_in_the_failing_step_is_answered_whole() -> None:
    """Its acknowledgement was due with the step that failed: it must still go out, or the stream would take
    the new engine's first delta for it (and lose that text)."""
    built: list[ResumableEngine] = []

    def factory() -> ResumableEngine:
        built.append(ResumableEngine(step_s=0.01, fail_at_step=None if built else 1))
        return built[-1]

    srv, _ = _server(factory)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcde"
        assert len(built) == 2 and built[1].added[0][2] == 0  # re-admitted before it had any token
    finally:
        srv.stop()


def test_past_the_restart_budget_the_server_stays_up_and_says_why() -> None:
    built: list[ResumableEngine] = []

    def factory() -> ResumableEngine:
        built.append(ResumableEngine(step_s=0.01, fail_at_step=2))  # every engine fails
        return built[-1]

    srv, ae = _server(factory, max_engine_restarts=2)
    try:
        events = _stream(srv.url, {"prompt": "x", "max_tokens": 20})
        err = json.loads(events[-1])["error"]
        assert err["code"] == 503 and "[DONE]" not in events
        assert "worker died" in err["message"] and "gives up (max_engine_restarts=2)" in err["message"]
        assert "Traceback" not in err["message"]
        assert len(built) == 3  # the first engine and two rebuilds
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "down" and "gives up" in h.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 200  # the server itself is up
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "gives up" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_a_rebuild_that_fails_is_tried_again_after_a_backoff() -> None:
    calls: list[float] = []

    def factory() -> ResumableEngine:
        calls.append(time.monotonic())
        if len(calls) == 2:  # the first rebuild fails, as when the new workers cannot be placed
            raise RuntimeError("could not place the workers")
        return ResumableEngine(step_s=0.01, fail_at_step=4 if len(calls) == 1 else None)

    srv, ae = _server(factory, restart_backoff_s=0.3)
    try:
        assert _text(_stream(srv.url, {"prompt": "x", "max_tokens": 10})) == LETTERS[:10]
        assert len(calls) == 3 and ae.engine_restarts == 1
        assert calls[2] - calls[1] >= 0.3  # backed off before the second try
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    finally:
        srv.stop()


def test_a_request_that_cannot_be_resumed_ends_with_a_clear_error() -> None:
    built: list[FakeEngine] = []

    def factory() -> FakeEngine:  # the plain fake takes no output_token_ids: nothing can be resumed
        built.append(FakeEngine(step_s=0.01, fail_at_step=None if built else 4))
        return built[-1]

    srv, _ = _server(factory)
    try:
        events = _stream(srv.url, {"prompt": "x", "max_tokens": 20})
        err = json.loads(events[-1])["error"]
        assert err["code"] == 503 and "could not be resumed" in err["message"] and "send it again" in err["message"]
        # The new engine serves new requests.
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
    finally:
        srv.stop()


def test_health_is_degraded_while_a_worker_is_restored_and_requests_are_served() -> None:
    engine = ResumableEngine(step_s=0.001)
    engine.recovery = SimpleNamespace(restoring=("draft",))  # what engine/execution/recovery.py reports meanwhile
    srv, _ = _server(lambda: ResumableEngine(), engine)
    try:
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded" and h.json()["restoring"] == ["draft"]
        assert "draft" in h.json()["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        engine.recovery.restoring = ()
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    finally:
        srv.stop()


def test_recovery_reports_the_role_it_restores() -> None:
    """``Recovery.restoring``: the target while the step waits for its replacement, a draft in the background."""
    from engine.execution.recovery import Recovery

    seen: list[tuple[str, ...]] = []

    class Executor:
        step_timeout_s = 600.0

        def in_flight(self):
            return []

        def begin_restart(self, role):
            pass

        def finish_restart(self, role, block):
            seen.append(rec.restoring)
            return False

    eng = SimpleNamespace(executor=Executor(), lose_worker_state=lambda role: None)
    rec = Recovery(eng, max_restarts=3, window_s=60)
    from engine.execution.faults import WorkerDiedError

    rec.recover(WorkerDiedError("target", 1, "killed"))
    assert seen == [("target",)] and rec.restoring == ()
    rec.recover(WorkerDiedError("draft", 0, "killed"))
    assert rec.restoring == ("draft",)  # decoding goes on without it meanwhile


# ------------------------------------------------------------------------------------- the built-in pair

@pytest.mark.slow
def test_engine_restart_with_streams_and_a_batch_job_in_flight(tmp_path) -> None:
    from engine.core.args import EngineArgs
    from engine.core.config import DEFAULT_MODELS_DIR
    from engine.core.llm_engine import LLMEngine
    from engine.jobs.store import JobStore
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.batches import batch_router
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig
    from scheduler.sampling_params import SamplingParams

    prompts = [json.loads(ln)["prompt"][:40]
               for ln in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()][:28]
    streams = [(prompts[i], 40) for i in range(4)]  # (prompt, max_tokens)
    lines = [(prompts[4 + i], 4 + i % 4) for i in range(24)]  # 4 in flight at a time: the job outlasts the fault
    config = EngineArgs().to_engine_config()
    added: list[tuple[int, str, int, int]] = []  # (engine number, request id, priority, tokens resumed from)
    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        e = LLMEngine(config)
        n, add = len(engines), e.add_request

        def recording_add(rid, prompt, params, priority=0, output_token_ids=None):
            added.append((n, rid, priority, len(output_token_ids or [])))
            return add(rid, prompt, params, priority=priority, output_token_ids=output_token_ids)

        e.add_request = recording_add
        engines.append(e)
        return e

    first = factory()
    # The reference: the same requests on the same engine, no fault, no server.
    work = streams + lines
    for i, (p, n) in enumerate(work):
        first.add_request(f"ref{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ref: dict[str, str] = {}
    while first.has_unfinished:
        ref.update({o.request_id: o.text for o in first.step_finished()})
    expected = [ref[f"ref{i}"] for i in range(len(work))]
    added.clear()

    # The fault hook: once armed, the next step fails as an engine out of worker restarts does.
    armed, fired = threading.Event(), threading.Event()
    step = first.step

    def faulty_step():
        if armed.is_set() and not fired.is_set():
            fired.set()
            raise TooManyRestartsError(["target rank 1 died: killed by the test"], 3, 60.0)
        time.sleep(0.02)  # slower steps: the fault lands while the streams are mid-way
        return step()

    first.step = faulty_step
    store = JobStore(tmp_path)
    ae = AsyncEngine(first, max_queue=64, metrics=ServerMetrics("m"), engine_factory=factory,
                     restart_backoff_s=0.01)
    app = build_app(ae, ServerConfig("m"), first.tokenizer,
                    extra_routers=[batch_router(store, max_in_flight=4, poll_s=0.05, retry_s=0.05)])
    srv = ThreadServer(app)
    health = HealthPoller(srv.url)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        rows = [{"custom_id": f"line{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}}
                for i, (p, n) in enumerate(lines)]
        fid = c.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                             purpose="batch").id
        batch = c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h")
        wait_until(lambda: store.get_batch(batch.id)["request_counts"]["completed"] >= 1, 60,
                   what="a batch line written")
        got: dict[int, list[str]] = {}
        started = [threading.Event() for _ in streams]

        def run_stream(i: int) -> None:
            p, n = streams[i]
            events = []
            body = {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[len("data: "):])
                        started[i].set()
            got[i] = events

        threads = [threading.Thread(target=run_stream, args=(i,)) for i in range(len(streams))]
        for t in threads:
            t.start()
        wait_until(lambda: all(s.is_set() for s in started), 60, what="the streams under way")
        armed.set()
        wait_until(fired.is_set, 30, what="the injected fault")
        assert store.get_batch(batch.id)["request_counts"]["completed"] < len(lines)  # the job was in flight
        for t in threads:
            t.join(120)
        assert [_text(got[i]) for i in range(len(streams))] == expected[: len(streams)]
        b = wait_until(lambda: (lambda b: b if b.status == "completed" else None)(c.batches.retrieve(batch.id)),
                       120, what="the batch job to complete")
        assert b.request_counts.completed == len(lines) and b.request_counts.failed == 0
        out = [json.loads(ln) for ln in c.files.content(b.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)  # each exactly once
        texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in out}
        assert [texts[f"line{i}"] for i in range(len(lines))] == expected[len(streams):]
        # Every request entered an engine fresh exactly once; the second engine took the open ones over from
        # their tokens so far (a batch line redone would be a second fresh add, under a new request id).
        assert len(engines) == 2 and ae.engine_restarts == 1
        fresh = [a for a in added if a[3] == 0 and not (a[0] == 1 and a[1] in {x[1] for x in added if x[0] == 0})]
        assert sum(1 for a in fresh if a[2] == 0) == len(streams) and sum(1 for a in fresh if a[2] == 1) == len(lines)
        resumed = [a for a in added if a[0] == 1 and a[3] > 0]
        assert sum(1 for a in resumed if a[2] == 0) == len(streams)  # every stream was mid-way
        wait_until(lambda: health.seen[-1] == (200, "ok"), 10, what="/health ok again")
        seen = health.stop()
        assert (503, "restarting") in seen and seen[-1] == (200, "ok"), seen
    finally:
        health.stop()
        srv.stop()
