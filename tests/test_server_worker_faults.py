"""The server through a worker kill on the Ray path (CPU, Gloo): streams in flight, target rank 1 killed with
SIGKILL; every stream completes with the greedy output of a run without the fault, and ``/health`` says
"degraded" (restoring the target) while the engine rebuilds the rank's group, "ok" after.

The fixtures (a Ray cluster, the tiny TP pair, the in-process no-fault reference) are test_worker_faults.py's.
The tiny target has no tokenizer, so streams carry no text: the tokens each stream got are read from the
engine's deltas, on the loop thread, by request id.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from engine.core.args import EngineArgs
from tests.conftest import TP_PROMPTS, TPModels
from tests.helpers_server import HealthPoller, ThreadServer, wait_until
from tests.test_worker_faults import MAX_TOKENS, ray_cluster, reference, speculative  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow  # a Ray cluster and a server


def test_streams_survive_a_dead_target_rank_and_health_shows_degraded(  # noqa: F811 (fixtures by name)
        ray_cluster, tp_models: TPModels, reference) -> None:  # noqa: F811
    from engine.core.llm_engine import LLMEngine
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig

    config = EngineArgs(target=tp_models.target, speculative_config=speculative(tp_models),
                        tensor_parallel_size=2).to_engine_config()
    engine = LLMEngine(config)
    tokens: dict[str, list[int]] = {}
    steps: list[float] = []
    step = engine.step

    def step_and_kill():  # on the loop thread, the only one that touches the engine
        steps.append(time.monotonic())
        if len(steps) == 3:  # every stream has been admitted and has tokens by now
            pid = next(w["pid"] for w in engine.executor.describe() if w["role"] == "target" and w["rank"] == 1)
            os.kill(pid, signal.SIGKILL)
        deltas = step()
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        return deltas

    engine.step = step_and_kill
    ae = AsyncEngine(engine, max_queue=64, metrics=ServerMetrics("tp"))
    srv = ThreadServer(build_app(ae, ServerConfig("tp"), None))
    health = HealthPoller(srv.url, interval_s=0.02)
    try:
        wait_until(lambda: health.seen, 10, what="the first /health answer")  # before the kill
        got: dict[int, list[str]] = {}

        def run(i: int) -> None:
            body = {"prompt": TP_PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                got[i] = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TP_PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(steps) >= 3, "the job finished before the kill"
        for i in range(len(TP_PROMPTS)):
            events = got[i]
            assert events[-1] == "[DONE]", events[-2:]  # completed, no error event
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length"
            assert tokens[last["id"] + "-0"] == reference[0][i]  # greedy: identical to the no-fault run
        stats = engine.recovery.stats
        assert stats.restarts == {"target": 1} and "target rank 1 died" in stats.failures[0]
        wait_until(lambda: health.seen[-1] == (200, "ok"), 10, what="/health ok again")
        seen = health.stop()
        assert (200, "degraded") in seen and seen[0] == (200, "ok") and seen[-1] == (200, "ok"), seen
        assert all(code == 200 for code, _ in seen)  # a worker restart never takes the server down
    finally:
        health.stop()
        srv.stop()
