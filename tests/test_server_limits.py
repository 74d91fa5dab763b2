"""``specserve serve`` with a key and a tiny queue, on the built-in pair: 401 without the key, 429 past the queue
bound, and a non-loopback bind refused without a key."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers_server import SubprocessServer, metric_value, wait_until

KEY = "test-key-7f3a"
MODEL = "specserve-default"


@pytest.fixture(scope="module")
def server():
    # One running slot and one waiting place; the key from the environment, as a deployment would set it.
    srv = SubprocessServer("--max-num-seqs", "1", "--max-queue", "1", "--retry-after", "2",
                           env={"OMP_NUM_THREADS": "1", "SPECSERVE_API_KEY": KEY})
    yield srv
    assert srv.stop() in (0, -15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]


@pytest.mark.slow
def test_401_without_the_key(server) -> None:
    for key in ("wrong", KEY[:-1], KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.post(server.url + "/v1/chat/completions", json={}).status_code == 401
    # /health and /metrics stay open (probes and scrapers carry no key).
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric_value(httpx.get(server.url + "/metrics").text, "specserve:request_errors_total",
                        {"error": "unauthorized"}) >= 5
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="def f():", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_429_past_the_queue_bound(server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"model": MODEL, "prompt": "def f():", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = server.url + "/v1/completions"
    with httpx.Client(timeout=60, headers=auth) as http:
        with http.stream("POST", url, json=long) as a:
            lines_a = a.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines_a)
            wait_until(lambda: metric_value(http.get(server.url + "/metrics").text,
                                            "specserve:num_requests_running") == 1, what="A running")
            with http.stream("POST", url, json=long) as b:
                assert b.status_code == 200  # B takes the one waiting place
                client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
                with pytest.raises(openai.RateLimitError) as exc:
                    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
                assert exc.value.response.headers["retry-after"] == "2"
                text = http.get(server.url + "/metrics").text
                assert metric_value(text, "specserve:num_requests_waiting") == 1
                assert metric_value(text, "specserve:request_errors_total", {"error": "overloaded"}) == 1
        wait_until(lambda: metric_value(http.get(server.url + "/metrics").text,
                                        "specserve:num_requests_running") == 0, what="A and B aborted")
        r = http.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_non_loopback_bind_needs_a_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2  # refused before any model is loaded
    out = capsys.readouterr()
    assert out.out == "" and "--api-key" in out.err and "0.0.0.0" in out.err


@pytest.mark.slow
def test_large_bodies_get_413_and_leave_no_memory_behind(server) -> None:
    """A 10 MB body (declared) and a 200 MB one (chunked, in the ``user`` field): 413 without reading them whole,
    ``/health`` answering within 0.5 s meanwhile, and the server's RSS back within 50 MB."""
    import threading
    import time

    import psutil

    proc = psutil.Process(server.proc.pid)
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = server.url + "/v1/completions"
    rss_before = proc.memory_info().rss
    worst, stop = [0.0], threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get(server.url + "/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - t0)
                stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ten = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "user": "' + b"u" * 10**7 + b'"}'
        r = httpx.post(url, content=ten, headers=auth, timeout=60)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text[:300]

        def two_hundred():
            yield b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "user": "'
            for _ in range(200):
                yield b"u" * 10**6
            yield b'"}'

        r = httpx.post(url, content=two_hundred(), headers=auth, timeout=60)
        assert r.status_code == 413, r.text[:300]
    finally:
        stop.set()
        watcher.join(30)
    growth = proc.memory_info().rss - rss_before
    print(f"slowest /health {worst[0]:.3f} s; server RSS {rss_before / 2**20:.0f} MiB before, "
          f"{growth / 2**20:+.1f} MiB after")
    assert worst[0] < 0.5, worst
    assert growth < 50 * 2**20, growth / 2**20
