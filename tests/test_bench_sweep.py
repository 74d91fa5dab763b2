"""``specserve bench sweep``: knee finding on synthetic ladders, the server process manager, and whole sweeps
against stub servers that saturate at a known concurrency (given as URLs, and started by the sweep itself)."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time

import pytest

from benchmarks.knee import find_knee, stop_climbing
from benchmarks.server_process import ServerProcess
from benchmarks.sweep import main as sweep_main
from benchmarks.sweep import parse_configs, parse_ladder
from tests.stub_openai_server import Schedule, StubServer

LOADS = [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("throughput,knee", [
    ([10, 20, 40, 80, 81, 80], 3),  # rises, then a plateau: the knee is where it flattens
    ([10, 20, 40, 80, 60, 40], 3),  # rises, then falls (speculation at large batch): the peak
    ([10, 20, 40, 78, 80, 81], 3),  # a plateau that creeps up within the tolerance
    ([50, 51, 50, 52, 49, 50], 0),  # saturated from the start (decode-bound at batch 1)
    ([10, 20, 30, 40, 50, 60], None),  # still rising at the top: not saturated, extend the ladder
    ([10, 20, 40, 80, 81, 100], None),  # a late rise beyond the tolerance moves the knee past the ladder
])
def test_knee_on_synthetic_ladders(throughput, knee):
    k = find_knee(LOADS, throughput, tolerance=0.05)
    assert k.index == knee
    assert k.saturated == (knee is not None)
    assert k.max_output_throughput == max(throughput)
    if knee is not None:
        assert k.load == LOADS[knee] and k.output_throughput == throughput[knee]
    else:
        assert "still rising" in k.reason


def test_knee_reports_whether_latency_climbs():
    thr = [10, 20, 40, 41, 40]
    loads = LOADS[:5]
    climbing = find_knee(loads, thr, ttft=[100, 101, 110, 300, 900], queue=[0, 0, 0.5, 3, 10])
    assert climbing.index == 2 and climbing.latency_climbing is True
    flat = find_knee(loads, thr, ttft=[100, 101, 110, 111, 110], queue=[0, 0, 0, 0, 0])
    assert flat.index == 2 and flat.latency_climbing is False and "did not climb" in flat.reason
    only_queue = find_knee(loads, thr, ttft=[100, 101, 110, 111, 110], queue=[0, 0, 1, 3, 9])
    assert only_queue.latency_climbing is True
    assert find_knee(loads, thr).latency_climbing is None  # nothing measured


def test_knee_with_an_infinite_rate_rung_and_bad_input():
    k = find_knee([0.5, 1, 2, math.inf], [5, 10, 12, 12])
    assert k.index == 2 and k.load == 2
    with pytest.raises(ValueError):
        find_knee([1, 2], [1])
    with pytest.raises(ValueError):
        find_knee([2, 1], [1, 2])
    with pytest.raises(ValueError):
        find_knee([], [])


def test_stop_climbing_past_the_knee():
    assert not stop_climbing([1, 2, 4], [10, 20, 21], points_past_knee=2)  # knee at 2, one rung past it
    assert stop_climbing([1, 2, 4, 8], [10, 20, 21, 20], points_past_knee=2)
    assert not stop_climbing([1, 2, 4, 8], [10, 20, 21, 20], points_past_knee=0)  # 0: the whole ladder
    assert not stop_climbing([1, 2, 4, 8], [10, 20, 40, 80], points_past_knee=1)


def test_parse_ladder_and_configs():
    assert parse_ladder("1,2,4", None) == ("concurrency", [1.0, 2.0, 4.0])
    assert parse_ladder(None, "0.5,1,inf") == ("request_rate", [0.5, 1.0, math.inf])
    for c, r in (("1,2", "1"), (None, None), ("2,1", None), ("1,1.5", None), (None, "0,1")):
        with pytest.raises(ValueError):
            parse_ladder(c, r)
    cfgs = parse_configs(["off=none", 'k4={"num_speculative_tokens": 4, "model": "/d"}', '{"model": "/e"}'],
                         ["vllm=http://h:8000/"], [])
    assert [c.name for c in cfgs] == ["off", "k4", "config2", "vllm"]
    assert cfgs[0].speculative_config == "none" and json.loads(cfgs[1].speculative_config)["model"] == "/d"
    assert cfgs[3].url == "http://h:8000"
    from engine.core.config import default_model_dirs

    try:
        draft = default_model_dirs()[1]
    except FileNotFoundError:
        draft = None
    if draft is not None:  # no draft named, built-in target: the built-in draft
        c = parse_configs(['k2={"num_speculative_tokens": 2}'], None, [])[0]
        assert json.loads(c.speculative_config)["model"] == draft
    c = parse_configs(['k2={"num_speculative_tokens": 2}'], None, ["--target", "/t"])[0]
    assert "model" not in json.loads(c.speculative_config)  # the user's own target: the server must be told
    with pytest.raises(ValueError, match="differ"):
        parse_configs(["a=none", "a=none"], None, [])
    with pytest.raises(ValueError, match="at least one"):
        parse_configs(None, None, [])


def _stub_cmd(schedule: Schedule) -> list[str]:
    return [sys.executable, "-m", "tests.stub_openai_server", "--schedule", json.dumps(schedule.__dict__)]


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_server_process_starts_serves_and_stops(tmp_path):
    import httpx

    sp = ServerProcess(_stub_cmd(Schedule()), str(tmp_path / "s.log"), startup_timeout_s=30, env=_env())
    with sp:
        assert httpx.get(sp.url + "/health", timeout=5).status_code == 200
        pid = sp.proc.pid
    assert sp.proc.poll() is not None  # stopped
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_server_process_failures_are_bounded_and_explained(tmp_path):
    quits = [sys.executable, "-c", "import sys; print('no model here', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="status 3") as e:
        with ServerProcess(quits, str(tmp_path / "q.log"), startup_timeout_s=30):
            pass
    assert "no model here" in str(e.value)
    silent = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    sp = ServerProcess(silent, str(tmp_path / "s.log"), startup_timeout_s=1.0, stop_timeout_s=5)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="did not print its URL"):
        with sp:
            pass
    assert time.monotonic() - t < 20
    assert sp.proc.poll() is not None  # killed, not left behind


def test_a_sweep_stopped_with_sigterm_stops_its_servers(tmp_path):
    """The server runs in a session of its own (so stopping it reaches its workers); a SIGTERM to the process
    that started it must stop it too, not leave it serving (Python's default SIGTERM skips every ``with``)."""
    import signal
    import subprocess

    code = ("import sys, time; from benchmarks.server_process import ServerProcess\n"
            f"with ServerProcess({_stub_cmd(Schedule())!r}, {str(tmp_path / 's.log')!r}, startup_timeout_s=30,"
            " stop_timeout_s=5) as sp:\n"
            "    print(sp.proc.pid, flush=True)\n"
            "    time.sleep(60)\n")
    sweep = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        server_pid = int(sweep.stdout.readline())
        os.kill(server_pid, 0)  # serving
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=20) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(server_pid, 0)
    finally:
        sweep.kill()
        sweep.wait()


# Two stub "servers": one generates for at most 2 requests at a time, the other for 4; a request holds its slot
# 50 + 7 x 20 ms. Between one request's end and the next one's arrival a slot idles (the client's turnaround:
# a few ms on an idle machine, tens when the cores are shared), so at concurrency = capacity throughput can fall
# short of the plateau by more than the tolerance: the knee is at the capacity or one rung above.
SMALL = Schedule(first_token_s=0.05, interval_s=0.02, capacity=2)
BIG = Schedule(first_token_s=0.05, interval_s=0.02, capacity=4)
WORKLOAD = ["--num-prompts", "4", "--prompts-per-concurrency", "2", "--output-len", "8", "--warmup-requests", "1",
            "--knee-tolerance", "0.15", "--metrics-interval", "0.1", "--no-progress"]


def _check_outputs(out, names: list[str]) -> dict:
    sweep = json.loads((out / "sweep.json").read_text())
    assert [c["name"] for c in sweep["configs"]] == names
    for name in ("throughput.png", "tpot.png", "ttft_cdf.png", "acceptance.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (out / "sweep.md").read_text()
    for n in names:
        assert f"| {n} |" in md
    return sweep


@pytest.mark.slow
def test_sweep_against_running_servers_finds_their_knees(tmp_path):
    with StubServer(SMALL) as small, StubServer(BIG) as big:
        rc = sweep_main(["--url", f"cap2={small.url}", "--url", f"cap4={big.url}", "--concurrency", "1,2,4,8,16",
                         "--stop-past-knee", "1", "--out-dir", str(tmp_path), *WORKLOAD])
    assert rc == 0
    sweep = _check_outputs(tmp_path, ["cap2", "cap4"])
    assert sweep["ladder"] == {"kind": "concurrency", "values": [1, 2, 4, 8, 16]}
    cap2, cap4 = sweep["configs"]
    assert cap2["knee"]["load"] in (2, 4) and cap4["knee"]["load"] in (4, 8), (cap2["knee"], cap4["knee"])
    assert cap4["knee"]["load"] >= cap2["knee"]["load"]
    for c in (cap2, cap4):
        assert c["knee"]["saturated"] and c["knee"]["latency_climbing"]
        # the ladder stopped one rung past the knee
        assert [p["load"] for p in c["points"]] == [1, 2, 4, 8, 16][:c["knee"]["index"] + 2]
        assert [p["num_prompts"] for p in c["points"]] == [4, 4, 8, 16, 32][:len(c["points"])]
        assert all(p["result"]["failed"] == 0 and p["result"]["max_concurrent_requests"] <= p["load"]
                   for p in c["points"])
        assert c["points"][0]["result"]["spec_decode"]["mean_acceptance_length"] == pytest.approx(3.0)
        # past the knee the queue grows: the server's own waiting count, sampled from /metrics
        assert c["points"][-1]["result"]["server_load"]["max_waiting"] > 0
    # saturation throughput of the 4-slot server is about twice the 2-slot one's, and the table says so
    ratio = cap4["knee"]["max_output_throughput"] / cap2["knee"]["max_output_throughput"]
    assert 1.5 < ratio < 2.5
    row = next(line for line in (tmp_path / "sweep.md").read_text().splitlines() if line.startswith("| cap4 |"))
    assert f"| {ratio:.2f} |" in row


@pytest.mark.slow
def test_interleaved_sweep_alternates_configs_within_each_rung(tmp_path):
    """--interleave --repeats 2: rung by rung, each configuration in turn, twice in rotating order (A B, B A), and
    the run kept is the median (the lower of two) with every run's throughput listed."""
    with StubServer(SMALL) as a, StubServer(BIG) as b:
        rc = sweep_main(["--url", f"a={a.url}", "--url", f"b={b.url}", "--concurrency", "1,2", "--interleave",
                         "--repeats", "2", "--stop-past-knee", "0", "--out-dir", str(tmp_path), *WORKLOAD])
        # each run: 4 requests (the warm-up: 1), one after another at concurrency 1, two at a time at 2
        runs = []
        for name, server in (("a", a), ("b", b)):
            times = sorted(t["received"] for t in server.state()["timeline"])[1:]  # less the warm-up
            assert len(times) == 16
            runs += [(times[i], times[i + 3], name) for i in range(0, 16, 4)]
    assert rc == 0
    runs.sort()
    assert [r[2] for r in runs] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert all(x[1] < y[0] for x, y in zip(runs, runs[1:], strict=False)), "a run overlapped the previous one"
    sweep = _check_outputs(tmp_path, ["a", "b"])
    for c in sweep["configs"]:
        assert [p["load"] for p in c["points"]] == [1, 2]
        for p in c["points"]:
            reps = p["repeats_output_throughput"]
            assert len(reps) == 2 and reps == sorted(reps)
            assert p["result"]["output_throughput"] == reps[0]
    with pytest.raises(ValueError, match="--repeats .* needs --interleave"):
        sweep_main(["--url", "a=http://127.0.0.1:9", "--concurrency", "1", "--repeats", "2",
                    "--out-dir", str(tmp_path)])


def test_sweep_starts_and_stops_its_servers(tmp_path, monkeypatch):
    """--config: the sweep starts one server per configuration (here the stub, standing in for `specserve
    serve` via --server-command), runs a rate ladder and stops each server before the next."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    cmd = shlex.join(_stub_cmd(SMALL))
    rc = sweep_main(["--config", "off=none", "--config", 'k4={"model": "/d", "num_speculative_tokens": 4}',
                     "--server-command", cmd, "--request-rates", "5,inf", "--stop-past-knee", "0",
                     "--out-dir", str(tmp_path), *WORKLOAD])
    assert rc == 0
    sweep = _check_outputs(tmp_path, ["off", "k4"])
    assert sweep["ladder"] == {"kind": "request_rate", "values": [5.0, "inf"]}
    for c in sweep["configs"]:
        assert c["server_command"][-4:-2] == ["--speculative-config", c["speculative_config"]]
        assert [p["load"] for p in c["points"]] == [5.0, "inf"]
        assert "specserve: serving on" in (tmp_path / f"server-{c['name']}.log").read_text()
    assert sweep["configs"][0]["url"] != sweep["configs"][1]["url"]  # a fresh server each


def test_sweep_keeps_going_when_a_server_fails(tmp_path):
    rc = sweep_main(["--url", "gone=http://127.0.0.1:9", "--concurrency", "1", "--out-dir", str(tmp_path),
                     "--warmup-requests", "0", "--num-prompts", "2", "--prompts-per-concurrency", "0",
                     "--no-progress", "--metrics-interval", "0", "--request-timeout", "5"])
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    # connection refused: every request failed and is kept; the sweep itself ran to the end
    assert rc == 0 and sweep["configs"][0]["points"][0]["result"]["failed"] == 2
    assert "ConnectError" in next(iter(sweep["configs"][0]["points"][0]["result"]["errors"]))


@pytest.mark.slow
def test_smoke_sweep_against_specserve_serve(tmp_path):
    """The real server on the built-in pair: the sweep starts `specserve serve` with speculation off and with a
    chain, runs a two-rung ladder with a few short requests, and stops both servers."""
    rc = sweep_main(["--config", "off=none", "--config", 'chain2={"num_speculative_tokens": 2}',
                     "--concurrency", "1,2", "--num-prompts", "2", "--prompts-per-concurrency", "1",
                     "--output-len", "8", "--warmup-requests", "1", "--startup-timeout", "120",
                     "--request-timeout", "60", "--metrics-interval", "0.5", "--no-progress",
                     "--out-dir", str(tmp_path)])
    assert rc == 0
    sweep = _check_outputs(tmp_path, ["off", "chain2"])
    off, chain = sweep["configs"]
    for c in (off, chain):
        assert [p["load"] for p in c["points"]] == [1, 2]
        for p in c["points"]:
            r = p["result"]
            assert (r["completed"], r["failed"]) == (2, 0), r["errors"]
            assert r["total_output_tokens"] == 16 and r["median_ttft_ms"] > 0 and r["median_tpot_ms"] > 0
    assert not any((p["result"]["spec_decode"] or {}).get("num_drafts") for p in off["points"])
    sd = chain["points"][0]["result"]["spec_decode"]
    assert sd["source"] == "specserve" and sd["num_drafts"] > 0 and 1.0 <= sd["mean_acceptance_length"] <= 3.0
    assert len(sd["per_position_acceptance_rate"]) == 2


def test_a_rung_without_streamed_tokens_logs_a_dash_not_nan(monkeypatch, capsys):
    """A server whose streams carry nothing until the end has no TTFT or TPOT: the rung's line says '-'."""
    import argparse

    from benchmarks import sweep

    result = {"output_throughput": 12.5, "median_ttft_ms": None, "median_tpot_ms": float("nan"), "failed": 0}
    monkeypatch.setattr(sweep, "config_from_args", lambda *a: None)
    monkeypatch.setattr(sweep, "build_requests", lambda *a: [])
    monkeypatch.setattr(sweep, "run_benchmark", lambda *a: result)
    args = argparse.Namespace(num_prompts=1, prompts_per_concurrency=1)
    sweep.run_rung("http://127.0.0.1:1", "concurrency", 4, args, "a")
    line = capsys.readouterr().err.strip()
    assert line == "[a] concurrency 4: 12.5 out tok/s, TTFT p50 - ms, TPOT p50 - ms, failed 0", line
