"""A burst of 11x the queue bound at once against ``specserve serve`` (the built-in pair, a subprocess on an
ephemeral loopback port): the excess is refused with 429 + Retry-After, every admitted request gets its whole
completion exactly once, and the server's memory does not grow with the bursts.

``--max-num-seqs 2 --max-queue 4``: at most 2 running + 4 waiting are admitted at a time, so most of a burst of
44 must be refused. The server's own counters (finished requests, overloaded errors) must equal what the
clients saw: an admitted request that was lost or ran twice would show there.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import psutil
import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from tests.helpers_server import SubprocessServer, metric_value

pytestmark = pytest.mark.slow  # a `specserve serve` subprocess on the built-in pair

MODEL = "specserve-default"
MAX_QUEUE = 4
BURST = 11 * MAX_QUEUE
MAX_TOKENS = 6
PROMPTS = [json.loads(ln)["prompt"][:40]
           for ln in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()][:BURST]
RSS_GROWTH_BOUND = 150 * 2**20  # generous: a leak of one prompt's state per refused request would pass it soon


@pytest.fixture(scope="module")
def server():
    srv = SubprocessServer("--max-queue", str(MAX_QUEUE), "--max-num-seqs", "2", env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() in (0, -15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]


@pytest.fixture(scope="module")
def reference() -> list[str]:
    from engine import LLM, SamplingParams

    with LLM() as llm:
        return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                     ignore_eos=True))]


async def _burst(url: str) -> list[tuple[int, int, dict, dict]]:
    """Every prompt at once: (prompt index, status, headers, body) of each answer."""
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def one(i: int):
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)],
                                                      "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "ignore_eos": True})
            return i, r.status_code, dict(r.headers), r.json()

        return list(await asyncio.gather(*[one(i) for i in range(BURST)]))


def _counts(url: str) -> tuple[float, float]:
    """The server's finished-request and overloaded-error counters."""
    text = httpx.get(url + "/metrics").text
    done = metric_value(text, "specserve:request_success_total", {"model_name": MODEL, "finished_reason": "length"})
    over = metric_value(text, "specserve:request_errors_total", {"model_name": MODEL, "error": "overloaded"})
    return done or 0.0, over or 0.0


def test_burst_of_ten_times_the_queue_bound(server, reference) -> None:
    proc = psutil.Process(server.proc.pid)
    asyncio.run(_burst(server.url))  # warm-up: first-use allocations are not growth
    rss_before = proc.memory_info().rss
    for _ in range(3):
        done0, over0 = _counts(server.url)
        answers = asyncio.run(_burst(server.url))
        ok = [a for a in answers if a[1] == 200]
        refused = [a for a in answers if a[1] == 429]
        assert len(ok) + len(refused) == BURST, sorted({a[1] for a in answers})
        assert refused, "no request was refused: the queue bound is not enforced"
        assert len(ok) >= MAX_QUEUE  # at least a queue's worth is admitted
        for _, _, headers, body in refused:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["code"] == 429 and "max_queue=4" in body["error"]["message"]
        for i, _, _, body in ok:  # the whole completion, once: equal to the offline engine's
            (choice,) = body["choices"]
            assert choice["text"] == reference[i % len(PROMPTS)] and choice["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
        done1, over1 = _counts(server.url)
        assert (done1 - done0, over1 - over0) == (len(ok), len(refused))
    growth = proc.memory_info().rss - rss_before
    print(f"server RSS {rss_before / 2**20:.0f} MiB before 3 bursts of {BURST}, growth {growth / 2**20:+.1f} MiB")
    assert growth < RSS_GROWTH_BOUND
