"""Admission: a request waits (and counts against ``--max-queue``) only while no running slot is free, so a
burst into an idle server is admitted whole; a request with more prompts than the server can ever hold
(``--max-num-seqs`` + ``--max-queue``) is a 400 naming both, not a 429 to retry forever.

On a fake engine (fast) and on ``specserve serve`` with the built-in pair (slow).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import marked_slow
from tests.helpers_server import FakeEngine, SubprocessServer, ThreadServer, fake_app

SLOTS, QUEUE, BURST = 64, 8, 20


async def _burst(url: str, n: int, body: dict) -> list[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        return [r.status_code for r in await asyncio.gather(*[c.post("/v1/completions", json=body)
                                                              for _ in range(n)])]


@pytest.fixture(scope="module", params=marked_slow(["fake", "serve"], {"serve"}))
def url(request):
    if request.param == "fake":
        # Steps slow enough that the burst is all in flight before the first request finishes.
        app, _ = fake_app(FakeEngine(max_num_seqs=SLOTS, step_s=0.05), max_queue=QUEUE)
        srv = ThreadServer(app)
        yield srv.url
        srv.stop()
    else:
        srv = SubprocessServer("--max-queue", str(QUEUE), "--max-num-seqs", str(SLOTS), env={"OMP_NUM_THREADS": "1"})
        yield srv.url
        assert srv.stop() in (0, -15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]


def test_a_burst_into_free_slots_is_admitted_whole(url) -> None:
    statuses = asyncio.run(_burst(url, BURST, {"prompt": "def f():", "max_tokens": 8, "ignore_eos": True}))
    assert statuses == [200] * BURST, statuses


def test_a_request_that_can_never_fit_is_a_400(url) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": ["x"] * 257, "max_tokens": 1},  # the 257
                   timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--max-num-seqs 64" in err["message"] and "--max-queue 8" in err["message"] and err["param"] == "prompt"


def test_a_request_that_fills_slots_and_queue_exactly_is_admitted(url) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": ["x"] * (SLOTS + QUEUE), "max_tokens": 1}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == SLOTS + QUEUE, r.text[:300]
