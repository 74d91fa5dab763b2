"""The front door on a fake engine (no model): body limits (413 before the body is read), slow clients dropped
(partial headers, a partial body, an endless chunked body), and ``/health`` answering while a large body is
refused or a large prompt is tokenized. tests/test_server_limits.py runs the real server with a 200 MB body.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.jobs.store import JobStore
from engine.server.limits import ServerLimits, limited_protocol
from engine.server.metrics import ServerMetrics
from tests.helpers_server import FakeEngine, FakeTokenizer, ThreadServer, fake_stats, metric_value

LIMITS = ServerLimits(max_body_bytes=8 * 2**20, max_upload_bytes=12 * 2**20, header_timeout_s=0.6,
                      body_timeout_s=1.2)
KEY = "front-door-key"
HEALTH_WITHIN_S = 0.5


class SlowTokenizer(FakeTokenizer):
    """Takes a second per megabyte, as a real tokenizer does (releasing the GIL, as fast tokenizers do)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(len(text) / 1e6)
        return super().encode(text, add_special_tokens)


def _server(data_dir: Path, api_key: str | None = None) -> ThreadServer:
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.batches import batch_router
    from engine.server.serving import ServerConfig

    ae = AsyncEngine(FakeEngine(max_num_seqs=4, max_model_len=64), metrics=ServerMetrics("fake"),
                     stats_reader=fake_stats)
    store = JobStore(data_dir)
    app = build_app(ae, ServerConfig("fake"), SlowTokenizer(), api_key=api_key, limits=LIMITS,
                    extra_routers=[batch_router(store, poll_s=0.05)])
    metrics: ServerMetrics = ae.metrics
    metrics: ServerMetrics = ae.metrics
    return ThreadServer(app, http=limited_protocol(LIMITS.header_timeout_s, metrics.count_slow_client))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):
    s = _server(tmp_path_factory.mktemp("front-door"))
    yield s
    s.stop()


class HealthWatch:
    """GET /health in a loop on its own connection; the slowest answer seen."""

    def __init__(self, url: str) -> None:
        self.worst = 0.0
        self.count = 0
        self._stop = threading.Event()

        def run() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while not self._stop.is_set():
                    t0 = time.monotonic()
                    assert c.get("/health").status_code == 200
                    self.worst = max(self.worst, time.monotonic() - t0)
                    self.count += 1
                    self._stop.wait(0.02)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(30)
        return self.worst


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


def test_a_declared_body_past_the_limit_is_refused_unread(srv) -> None:
    watch = HealthWatch(srv.url)
    body = b'{"prompt": "' + b"x" * (10 * 10**6) + b'", "max_tokens": 1}'
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5  # a refusal faster than one probe: health must still answer right after it
    while watch.count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    worst = watch.stop()
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == 413 and "--max-body-bytes=8388608" in err["message"] and str(len(body)) in err["message"]
    assert took < 5 and worst < HEALTH_WITHIN_S and watch.count > 0, (took, worst)
    assert metric_value(_metrics(srv.url), "specserve:request_errors_total", {"error": "too_large"}) >= 1


def test_a_body_just_under_the_limit_is_parsed_without_stalling_others(srv) -> None:
    """JSON parsing and validation stay on the event loop, bounded by the limit: /health still answers."""
    watch = HealthWatch(srv.url)
    pad = LIMITS.max_body_bytes - 200
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 2, "user": "u" * pad})
    worst = watch.stop()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text[:300]
    assert worst < HEALTH_WITHIN_S, worst


def test_a_chunked_body_is_counted_as_it_arrives(srv) -> None:
    sent = 0

    def chunks():  # 200 MB offered; the server must stop reading long before
        nonlocal sent
        piece = b"x" * 2**20
        for _ in range(200):
            sent += len(piece)
            yield piece

    r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "received so far" in r.json()["error"]["message"]
    assert sent < 100 * 2**20, sent  # the client was cut off: the body was not read whole


def test_uploads_have_their_own_limit(srv) -> None:
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    ten_mb = line * (10 * 10**6 // len(line))  # past --max-body-bytes, within --max-upload-bytes
    r = httpx.post(srv.url + "/v1/files", files={"file": ("in.jsonl", ten_mb)}, data={"purpose": "batch"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["bytes"] == len(ten_mb), r.text[:300]
    r = httpx.post(srv.url + "/v1/files", files={"file": ("in.jsonl", ten_mb + ten_mb)}, data={"purpose": "batch"},
                   timeout=60)
    assert r.status_code == 413 and "--max-upload-bytes" in r.json()["error"]["message"]


def test_a_large_prompt_is_tokenized_off_the_event_loop(srv) -> None:
    """Under the body limit but past the context: the 400 comes after tokenizing megabytes; /health meanwhile."""
    watch = HealthWatch(srv.url)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "y" * (2 * 10**6)}], "max_tokens": 1})
    worst = watch.stop()
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    assert worst < HEALTH_WITHIN_S and watch.count > 2, worst


def _dropped_after(url: str, raw: bytes) -> tuple[float, bytes]:
    """Send ``raw`` and nothing more: (seconds until the server closed, what it answered)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return time.monotonic() - t0, got


SLOW = {
    "headers": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: appl",
    "body": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\": ",
    "chunked": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               b"ffffffffffffffff\r\n{\"prompt\": ",
}


@pytest.mark.parametrize("shape", sorted(SLOW))
def test_slow_clients_are_dropped_in_time(srv, shape: str) -> None:
    phase = "headers" if shape == "headers" else "body"
    before = metric_value(_metrics(srv.url), "specserve:slow_clients_dropped_total", {"phase": phase}) or 0
    took, got = _dropped_after(srv.url, SLOW[shape])
    limit = LIMITS.header_timeout_s if phase == "headers" else LIMITS.body_timeout_s
    assert limit * 0.8 < took < limit + 1.5, took
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    after = metric_value(_metrics(srv.url), "specserve:slow_clients_dropped_total", {"phase": phase})
    assert after == before + 1


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(srv) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole response (it may come in pieces)
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(LIMITS.header_timeout_s * 1.5)  # idle between requests: not a slow client
        s.sendall(SLOW["headers"])
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        took = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 408") and LIMITS.header_timeout_s * 0.8 < took < LIMITS.header_timeout_s + 1.5


def test_an_unauthenticated_trickle_is_closed_at_once(tmp_path: Path) -> None:
    """The key is checked on the headers: a 401 goes out and the connection closes, whatever the body does."""
    s = _server(tmp_path, api_key=KEY)
    try:
        took, got = _dropped_after(s.url, SLOW["chunked"])
        assert got.startswith(b"HTTP/1.1 401") and took < LIMITS.body_timeout_s, (took, got[:200])
        took, _ = _dropped_after(s.url, SLOW["headers"])
        assert LIMITS.header_timeout_s * 0.8 < took < LIMITS.header_timeout_s + 1.5
    finally:
        s.stop()


def test_keep_alive_survives_the_limits(srv) -> None:
    """Whole requests on one connection are not cut: the deadlines re-arm per request and are met."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["choices"][0]["text"] \
                == "ab"
        time.sleep(LIMITS.header_timeout_s / 2)
        assert c.get("/health").status_code == 200


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="--max-body-bytes"):
        ServerLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="--header-timeout"):
        ServerLimits(header_timeout_s=0)
