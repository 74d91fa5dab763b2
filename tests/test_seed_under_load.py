"""A seeded request gives the same text alone and among 8 concurrent streams (issue 48 item 6), against a real
``specserve serve`` on the built-in pair: with the draft in its own process, and with the target on 2 ranks.

Seed 101, T = 0.8, ``def work_1(items):``, 200 tokens: before the float32 kernels were row-invariant
(workers/kernels/), the text at concurrency 8 left the solo text at character 472, in both setups. The other 7
streams start staggered, with other prompts, seeds, lengths and no seed at all, so the seeded request's rows
share their forwards (prefill chunks, decode batches, verifies, drafts) with different rows in each run.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers_server import SubprocessServer

pytestmark = pytest.mark.slow  # `specserve serve` subprocesses (one with Ray and 2 target ranks)

MODEL = "specserve-default"
SEEDED = {"prompt": "def work_1(items):", "max_tokens": 200, "temperature": 0.8, "seed": 101, "ignore_eos": True}
OTHERS = [{"prompt": f"def work_{i}(items):\n    ", "max_tokens": 60 + 20 * i, "temperature": 0.8, "ignore_eos": True,
           **({"seed": i} if i % 2 else {})} for i in range(2, 9)]
TIMEOUT_S = 600


async def _stream(c: httpx.AsyncClient, body: dict, delay_s: float) -> str:
    await asyncio.sleep(delay_s)
    text = []
    async with c.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
    return "".join(text)


def _seeded_text(url: str, concurrent: bool, stagger_s: float) -> str:
    """The seeded stream's text, alone or with the 7 others started around it."""
    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as c:
            others = OTHERS if concurrent else []
            jobs = [_stream(c, SEEDED, 2 * stagger_s)] + [_stream(c, b, i * stagger_s) for i, b in enumerate(others)]
            return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT_S)

    return asyncio.run(run())[0]


@pytest.fixture(scope="module", params=["draft-process", "tp2"])
def server(request):
    if request.param == "draft-process":
        args = ["--speculative-config", json.dumps({"draft_process": True})]
    else:
        args = ["--tensor-parallel-size", "2"]
    srv = SubprocessServer(*args, env={"OMP_NUM_THREADS": "1"}, start_timeout_s=TIMEOUT_S)
    yield srv
    # SIGTERM: -15, or 15 where Ray's handler exits with the signal's number (the TP 2 server).
    assert srv.stop() in (0, -15, 15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]


def test_seeded_stream_is_the_same_alone_and_among_eight(server) -> None:
    solo = _seeded_text(server.url, concurrent=False, stagger_s=0)
    assert len(solo) > 472  # past where it diverged
    loaded = [_seeded_text(server.url, concurrent=True, stagger_s=s) for s in (0.05, 0.2)]
    assert loaded == [solo, solo]
