"""The replicated app on a local Ray Serve (engine/serve_replicas): two replicas of the built-in pair behind one
URL, the official client streaming, a replica killed mid-load losing nothing, autoscaling 1 -> 2 -> 1 under load.

One Ray and one Serve for the module; every wait is bounded. Slow: each engine replica loads the built-in pair
(seconds each on a loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

APP = "specserve-test"
PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]
MAX_TOKENS = 128  # long enough (seconds) that a kill lands mid-stream


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url():
    import ray
    from ray import serve

    from engine.execution.loopback import ray_on_loopback

    if ray.is_initialized():
        ray.shutdown()
    with ray_on_loopback():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def deploy(url: str, **args) -> None:
    from ray import serve

    from engine.serve_replicas.app import build_app
    from engine.serve_replicas.serve_cli import wait_healthy

    config = {"engine": {"max_num_seqs": 8}, "graceful_shutdown_timeout_s": 60.0, **args}
    serve.run(build_app(config), name=APP, route_prefix="/", blocking=False)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        st = serve.status().applications.get(APP)
        if st is not None and st.status == "RUNNING":
            break
        time.sleep(0.5)
    wait_healthy(url, max(1.0, deadline - time.monotonic()))


def running_replicas() -> int:
    from ray import serve

    dep = serve.status().applications[APP].deployments["EngineReplica"]
    return dep.replica_states.get("RUNNING", 0)


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> str:
    body = {"model": "specserve-default", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    parts = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event  # a stream that broke off mid-way
                parts.append(event["choices"][0]["text"])
    return "".join(parts)


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_replicas_stream_to_the_official_client_and_a_killed_replica_loses_nothing(serve_url, tmp_path):
    import openai
    from ray import serve

    deploy(serve_url, data_dir=str(tmp_path / "jobs"), replicas=2)
    assert running_replicas() == 2
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", timeout=120)
    chunks = list(client.completions.create(model="specserve-default", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True))
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == "length"
    assert client.models.list().data[0].id == "specserve-default"

    async def load(kill_after_tokens: bool) -> list[str]:
        async with httpx.AsyncClient() as c:
            before = metric(serve_url, "specserve:generation_tokens_total")
            tasks = [asyncio.create_task(complete(c, serve_url, p)) for p in PROMPTS]
            if kill_after_tokens:  # once both replicas stream, kill one (SIGKILL: no drain, no goodbye)
                deadline = time.monotonic() + 60
                while metric(serve_url, "specserve:generation_tokens_total") < before + 2 * len(PROMPTS):
                    assert time.monotonic() < deadline, "no tokens within 60 s"
                    await asyncio.sleep(0.05)
                stats = await serve.get_deployment_handle("EngineReplica", APP).stats.remote()
                os.kill(stats["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    reference = asyncio.run(load(False))
    assert metric(serve_url, "specserve:replica_requests_total") >= len(PROMPTS)
    per_replica = [ln for ln in httpx.get(serve_url + "/metrics").text.splitlines()
                   if ln.startswith("specserve:replica_requests_total{")]
    assert len(per_replica) == 2, per_replica  # both replicas served, each labeled
    assert metric(serve_url, "specserve:prefix_cache_queries_total") > 0  # the replicas' engine counters, summed
    # The Batch API: one job store (the ingress's), its lines spread over the replicas like online requests.
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "specserve-default", "prompt": p, "max_tokens": MAX_TOKENS,
                                         "temperature": 0}}) + "\n" for i, p in enumerate(PROMPTS[:4]))
    fid = httpx.post(serve_url + "/v1/files", files={"file": ("b.jsonl", lines)},
                     data={"purpose": "batch"}).json()["id"]
    batch = httpx.post(serve_url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"}).json()
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = httpx.get(f"{serve_url}/v1/batches/{batch['id']}").json()
    out = httpx.get(f"{serve_url}/v1/files/{batch['output_file_id']}/content").text.splitlines()
    texts = {json.loads(ln)["custom_id"]: json.loads(ln)["response"]["body"]["choices"][0]["text"] for ln in out}
    assert [texts[f"c{i}"] for i in range(4)] == reference[:4]
    survived = asyncio.run(load(True))
    assert survived == reference  # greedy: resumed from the tokens so far, the same text
    assert metric(serve_url, "specserve:replica_streams_lost_total") >= 1  # the kill did cut streams


def manifest_args(data_dir: str) -> dict:
    """The RayService's embedded Serve config (deploy/kuberay/rayservice.yaml) with what a CPU box must change:
    the device and model (the built-in pair), loopback, a local job store, no custom resources."""
    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "kuberay", "rayservice.yaml")
    with open(path) as f:
        svc = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "RayService")
    (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "engine.serve_replicas.app:build_app"
    args = dict(app["args"])
    args.update(host="127.0.0.1", data_dir=data_dir, ingress_resources={}, served_model_name="specserve-default")
    args["engine"] = {**args["engine"], "device": "cpu", "target": None, "speculative_config": None,
                      "max_num_seqs": 8}
    return args


def test_autoscaling_one_two_one_under_load_fails_no_request(serve_url, tmp_path):
    """Runs the KubeRay manifest's Serve config (tests/test_kuberay.py checks the manifest itself), its
    autoscaling bounds and delays shortened to fit a test."""
    args = manifest_args(str(tmp_path / "jobs"))
    args.update(replicas=1, graceful_shutdown_timeout_s=60.0,
                autoscaling={**args["autoscaling"], "min_replicas": 1, "max_replicas": 2,
                             "target_ongoing_requests": 2, "upscale_delay_s": 1.0, "downscale_delay_s": 2.0})
    deploy(serve_url, **args)
    assert running_replicas() == 1
    errors: list[BaseException] = []
    texts: dict[str, set[str]] = {}
    clients = {"n": 6}

    async def client_loop(i: int, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient() as c:
            while not stop.is_set() and i < clients["n"]:
                p = PROMPTS[i % len(PROMPTS)]
                try:
                    texts.setdefault(p, set()).add(await complete(c, serve_url, p))
                except BaseException as e:  # noqa: BLE001 - every failure counts
                    errors.append(e)
                    return

    async def scenario() -> list[int]:
        stop = asyncio.Event()
        loops = [asyncio.create_task(client_loop(i, stop)) for i in range(6)]
        seen = [running_replicas()]
        for want, n_clients in ((2, 6), (1, 1)):  # up under 6 clients, down to 1 with one still sending
            clients["n"] = n_clients
            deadline = time.monotonic() + 120
            while running_replicas() != want or serve_status_transitioning():
                assert time.monotonic() < deadline and not errors, (want, seen, errors)
                await asyncio.sleep(0.5)
            seen.append(running_replicas())
        await asyncio.sleep(2)  # one more request through the single replica
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 120)
        return seen

    seen = asyncio.run(scenario())
    assert not errors, errors
    assert seen == [1, 2, 1]
    assert all(len(v) == 1 for v in texts.values()), "a greedy prompt gave two different texts"
    # Drained, not cut: the replica removed finished its streams (a cut one would be resumed, but counted here).
    assert metric(serve_url, "specserve:replica_streams_lost_total") == 0


def serve_status_transitioning() -> bool:
    from ray import serve

    states = serve.status().applications[APP].deployments["EngineReplica"].replica_states
    return any(k != "RUNNING" and v for k, v in states.items())
