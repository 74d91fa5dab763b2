"""``specserve bench serve`` against a stub server with a known schedule: the reported latencies match the
schedule, failures are counted and kept, arrivals have the asked-for rate and burstiness, the concurrency cap
holds, and the speculative-decoding section is the difference of the server's counters."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks.openai_stream import CHAT
from benchmarks.serve import BenchConfig, run_benchmark
from benchmarks.serve_report import latency_stats, parse_goodput, peak_concurrency
from benchmarks.server_metrics import parse_metrics, spec_decode_delta
from benchmarks.workload import BenchRequest, arrival_offsets, load_jsonl, random_requests
from tests.stub_openai_server import ACCEPTED_PER_POS, DRAFT_TOKENS_PER_REQ, DRAFTS_PER_REQ, Schedule, StubServer

# The stub answers after 50 ms, streams the first token 100 ms later, then one every 20 ms.
SCHEDULE = Schedule(header_delay_s=0.05, first_token_s=0.10, interval_s=0.02)
N_OUT = 10
TTFT_MS = 150.0
ITL_MS = 20.0
E2EL_MS = TTFT_MS + (N_OUT - 1) * ITL_MS
TOL_MS = 5.0  # "within a few milliseconds": means and medians
# p90..p99 of a dozen requests are about the worst one: room for one late wake-up of the client on a machine
# whose 2 cores are shared (a few ms when idle; 21 ms over 20 was seen at load average 10, so leave room: the
# medians above are what catches a wrong clock)
TOL_TAIL_MS = 40.0


def _requests(n: int, fail_http: tuple[int, ...] = (), fail_stream: tuple[int, ...] = ()) -> list[BenchRequest]:
    out = []
    for i in range(n):
        prompt = "FAIL_HTTP please" if i in fail_http else "FAIL_STREAM please" if i in fail_stream else f"p {i}"
        out.append(BenchRequest(f"r{i}", prompt, {"max_tokens": N_OUT, "temperature": 0.0}))
    return out


def _cfg(url: str, **kw) -> BenchConfig:
    kw.setdefault("progress", False)
    kw.setdefault("metrics_interval_s", 0.2)
    return BenchConfig(base_url=url, **kw)


@pytest.fixture(scope="module")
def stub():
    with StubServer(SCHEDULE) as s:
        yield s


@pytest.fixture(scope="module")
def schedule_run(stub):
    """14 requests at 20/s, at most 4 in flight; request 3 gets a 500, request 8 a stream cut short. Returns
    the result and the stub's own timeline of the successful requests, by request index."""
    before = stub.state()["finished"]
    result = run_benchmark(_cfg(stub.url, request_rate=20.0, max_concurrency=4, seed=1),
                           _requests(14, fail_http=(3,), fail_stream=(8,)))
    state = stub.state()
    by_prompt = {t["prompt"]: t for t in state["timeline"]}
    timeline = {x["index"]: by_prompt[f"p {x['index']}"] for x in result["requests"] if x["success"]}
    return result, state["finished"] - before, timeline


def _delivered(result: dict, timeline: dict) -> dict[str, list[float]]:
    """TTFT, ITL, TPOT, E2EL as the stub actually sent them, seen from each request's send time (both processes
    read the host's monotonic clock): the schedule plus the real delivery and scheduling delays."""
    out: dict[str, list[float]] = {"ttft": [], "itl": [], "tpot": [], "e2el": []}
    for i, t in timeline.items():
        send = result["clock_start"] + result["requests"][i]["send_time"]
        ttft, e2el = t["chunks"][0] - send, t["done"] - send
        out["ttft"].append(ttft)
        out["itl"] += [b - a for a, b in zip(t["chunks"], t["chunks"][1:], strict=False)]
        out["e2el"].append(e2el)
        out["tpot"].append((e2el - ttft) / (N_OUT - 1))
    return out


def test_latency_percentiles_match_what_the_server_sent(schedule_run):
    """Every reported statistic equals the same statistic of the stub's own send times within a few ms: the
    client times each chunk when it reads it, TTFT and E2EL from the moment the request was sent."""
    r, _, timeline = schedule_run
    truth = _delivered(r, timeline)
    assert len(truth["ttft"]) == 12 and len(truth["itl"]) == 12 * (N_OUT - 1)
    for name, values in truth.items():
        want = latency_stats(name, values, r["percentiles"])
        for key, ms in want.items():
            if key.startswith("std_"):
                continue
            tol = TOL_MS if key.startswith(("mean", "median", "p50")) else TOL_TAIL_MS
            # A chunk is read after it is sent, never before: TTFT and E2EL can only be late. A gap can also
            # shrink (the chunk before it read late, this one on time).
            low = 0.5 if name in ("ttft", "e2el") else tol
            assert ms - low <= r[key] <= ms + tol, (key, r[key], ms)


def test_latency_percentiles_match_the_schedule(schedule_run):
    """Against the nominal schedule: ITL and TPOT (differences of client times) within a few ms; the schedule
    is a lower bound for every request's TTFT and E2EL (no token comes early; how much later it comes is the
    delivery and the server's own scheduling, which the test above accounts for)."""
    r, _, _ = schedule_run
    for name, ms in (("itl", ITL_MS), ("tpot", ITL_MS)):
        for stat in ("median", "p50"):
            assert r[f"{stat}_{name}_ms"] == pytest.approx(ms, abs=TOL_MS), (name, stat, r[f"{stat}_{name}_ms"])
    assert r["total_output_tokens"] == 12 * N_OUT
    assert r["total_input_tokens"] == 12 * 2  # the stub counts words
    for rec in r["requests"]:
        if rec["success"]:
            assert len(rec["itl"]) == N_OUT - 1 and rec["output_tokens"] == N_OUT
            assert rec["output_tokens_source"] == "usage"
            assert rec["ttft"] * 1000 >= TTFT_MS and rec["e2el"] * 1000 >= E2EL_MS


def test_failures_are_counted_and_kept(schedule_run):
    r, _, _ = schedule_run
    assert (r["completed"], r["failed"]) == (12, 2)
    recs = r["requests"]
    assert len(recs) == 14 and [x["index"] for x in recs] == list(range(14))
    assert not recs[3]["success"] and recs[3]["error"].startswith("HTTP 500")
    assert not recs[8]["success"] and "without [DONE]" in recs[8]["error"]
    assert sum(r["errors"].values()) == 2
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    assert r["output_throughput"] == pytest.approx(12 * N_OUT / r["duration"])


def test_max_concurrency_is_never_exceeded(stub):
    stub.reset_peak()
    r = run_benchmark(_cfg(stub.url, max_concurrency=3), _requests(10))  # all arrive at once
    assert stub.state()["peak"] == 3  # the server saw exactly the cap: never more, and the cap was reached
    assert r["max_concurrent_requests"] == 3
    assert r["completed"] == 10


def test_spec_decode_section_is_the_counter_difference(schedule_run):
    r, finished, _ = schedule_run
    assert finished == 12
    sd = r["spec_decode"]
    assert sd["source"] == "specserve"
    assert sd["num_drafts"] == 12 * DRAFTS_PER_REQ and sd["draft_tokens"] == 12 * DRAFT_TOKENS_PER_REQ
    assert sd["accepted_tokens"] == 12 * sum(ACCEPTED_PER_POS)
    assert sd["acceptance_rate"] == pytest.approx(sum(ACCEPTED_PER_POS) / DRAFT_TOKENS_PER_REQ)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sum(ACCEPTED_PER_POS) / DRAFTS_PER_REQ)
    assert sd["per_position_acceptance_rate"] == pytest.approx([a / DRAFTS_PER_REQ for a in ACCEPTED_PER_POS])
    assert r["server_load"]["samples"] >= 1 and r["server_load"]["max_running"] <= 4


def test_tpot_counts_tokens_from_usage_not_chunks():
    """Three tokens per chunk (a speculative burst): ITL is per chunk, TPOT per token, with the token count from
    usage (12), not from the chunks (4): 3 gaps of 30 ms over 11 tokens, not over 3."""
    with StubServer(Schedule(first_token_s=0.05, interval_s=0.03, tokens_per_chunk=3)) as s:
        reqs = [BenchRequest(f"c{i}", f"hello {i}", {"max_tokens": 12}) for i in range(4)]
        r = run_benchmark(_cfg(s.url, endpoint=CHAT, max_concurrency=2), reqs)
        state = s.state()
    assert r["completed"] == 4 and r["backend"] == "openai-chat"
    assert all(rec["output_tokens"] == 12 and rec["text_chunks"] == 4 for rec in r["requests"])
    sent = state["timeline"]
    true_tpot = statistics.median((t["done"] - t["chunks"][0]) / 11 for t in sent)
    true_itl = statistics.median(b - a for t in sent for a, b in zip(t["chunks"], t["chunks"][1:], strict=False))
    assert r["median_tpot_ms"] == pytest.approx(true_tpot * 1000, abs=1.0)
    assert r["median_tpot_ms"] == pytest.approx(3 * 30.0 / 11, abs=2.0)  # chunks instead of usage: 30 ms
    assert r["median_itl_ms"] == pytest.approx(true_itl * 1000, abs=TOL_MS)
    assert r["median_itl_ms"] == pytest.approx(30.0, abs=TOL_MS)
    assert all(rec["ttft"] >= 0.05 for rec in r["requests"])
    assert all(b["stream_options"] == {"include_usage": True} and b["model"] == "stub-model"
               for b in state["bodies"])


def test_send_times_follow_the_arrival_process(stub):
    """Without a concurrency cap, each request leaves at its scheduled arrival time."""
    cfg = _cfg(stub.url, request_rate=25.0, burstiness=0.5, seed=3)
    r = run_benchmark(cfg, _requests(12))
    want = arrival_offsets(12, 25.0, 0.5, seed=3)
    late = [rec["send_time"] - w for rec, w in zip(r["requests"], want, strict=True)]
    # never early; late only by the event loop's wake-up (deadlines, so lateness does not add up). On a loaded
    # 2-core CI machine one wake-up can stall for a few hundred ms (CI saw 255 ms once), so the bound is on
    # the three-quarters that were on time, not on the worst one.
    on_time = sorted(late)[: len(late) * 3 // 4]
    assert min(late) >= 0 and max(on_time) < 0.015 and max(late) < 1.0, late


def test_timeouts_fail_and_are_kept():
    with StubServer(Schedule(first_token_s=0.5)) as s:
        r = run_benchmark(_cfg(s.url, request_timeout_s=0.2), _requests(2))
    assert (r["completed"], r["failed"]) == (0, 2)
    assert all(rec["error"].startswith("timeout") for rec in r["requests"])
    assert r["median_ttft_ms"] is None


def test_goodput(stub):
    reqs = _requests(4)
    # SLOs far above the stub's 150 ms TTFT and 20 ms TPOT (a loaded machine stretched a TTFT past 300 ms), and an
    # end-to-end one below its ~330 ms minimum: all four requests are good, then none.
    good = run_benchmark(_cfg(stub.url, goodput_ms=parse_goodput(["ttft:2000", "tpot:200"])), reqs)
    bad = run_benchmark(_cfg(stub.url, goodput_ms=parse_goodput(["ttft:300", "e2el:200"])), reqs)
    assert good["request_goodput"] == pytest.approx(4 / good["duration"])
    assert bad["request_goodput"] == 0.0
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:3"])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_have_the_rate_and_burstiness(burstiness):
    """Gaps are Gamma(shape=b, mean=1/rate): mean 1/rate, squared coefficient of variation 1/b, and the gap
    distribution passes a Kolmogorov-Smirnov test against that gamma law."""
    from scipy import stats

    rate, n = 8.0, 20000
    t = arrival_offsets(n, rate, burstiness, seed=11)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    cv2 = statistics.pvariance(gaps) / mean**2
    # 20000 gaps: the mean's relative standard error is sqrt(1/b / n) <= 1.4%; the variance's a few %
    assert mean == pytest.approx(1 / rate, rel=0.05)
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.05)
    assert cv2 == pytest.approx(1 / burstiness, rel=0.10)
    assert stats.kstest(gaps, "gamma", args=(burstiness, 0, 1 / (rate * burstiness))).pvalue > 1e-3
    # the same seed, the same arrivals; another seed, others
    assert arrival_offsets(50, rate, burstiness, seed=11) == t[:50]
    assert arrival_offsets(50, rate, burstiness, seed=12) != t[:50]


def test_infinite_rate_and_bad_arrival_args():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, b)


def test_vllm_metric_names_are_read_and_labels_summed():
    def text(n: int) -> str:
        return "\n".join([
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {10 * n}',
            f'vllm:spec_decode_num_drafts_total{{engine="1",model_name="m"}} {10 * n}',
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {60 * n}',
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {30 * n}',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {16 * n}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {14 * n}',
            "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running 3", ""])

    sd = spec_decode_delta(parse_metrics(text(1)), parse_metrics(text(3)))
    assert sd["source"] == "vllm" and sd["num_drafts"] == 40 and sd["draft_tokens"] == 120
    assert sd["mean_acceptance_length"] == pytest.approx(1 + 60 / 40)
    assert sd["per_position_acceptance_rate"] == pytest.approx([32 / 40, 28 / 40])
    assert sd["chosen_depths"] is None and sd["mean_chosen_depth"] is None  # vLLM does not say
    assert spec_decode_delta(parse_metrics("# TYPE x counter\nx_total 1\n"), parse_metrics("x_total 2\n")) is None


def test_chosen_depths_of_a_run_from_specserve_metrics():
    """The adaptive policy's choices during the run: the counters' growth per depth, chains in the mean."""
    def text(plain: int, k4: int, tree: int) -> str:
        return "\n".join([
            "# TYPE specserve:spec_decode_num_drafts_total counter",
            f'specserve:spec_decode_num_drafts_total{{model_name="m"}} {k4 + tree}',
            "# TYPE specserve:spec_decode_chosen_depth_total counter",
            f'specserve:spec_decode_chosen_depth_total{{depth="0",model_name="m"}} {plain}',
            f'specserve:spec_decode_chosen_depth_total{{depth="4",model_name="m"}} {k4}',
            f'specserve:spec_decode_chosen_depth_total{{depth="tree:2x1",model_name="m"}} {tree}', ""])

    sd = spec_decode_delta(parse_metrics(text(5, 10, 1)), parse_metrics(text(35, 20, 1)))
    assert sd["chosen_depths"] == {"0": 30, "4": 10}  # the tree was not chosen during the run
    assert sd["mean_chosen_depth"] == pytest.approx(40 / 40)


def test_peak_concurrency_from_records():
    from benchmarks.openai_stream import RequestRecord

    recs = [RequestRecord(0, "a", send_time=0.0, e2el=1.0), RequestRecord(1, "b", send_time=0.5, e2el=1.0),
            RequestRecord(2, "c", send_time=1.0, e2el=1.0), RequestRecord(3, "d", send_time=1.5, e2el=None)]
    assert peak_concurrency(recs) == 2  # c starts as a ends


def test_workloads(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": "a", "prompt": "x", "max_tokens": 5}\n\n{"prompt_token_ids": [1, 2], "seed": 3}\n')
    reqs = load_jsonl(str(p), 5, {"max_tokens": 9, "ignore_eos": True})
    assert [r.request_id for r in reqs] == ["a", "1", "a#1", "1#1", "a#2"]
    assert reqs[0].params == {"max_tokens": 5, "ignore_eos": True}
    assert reqs[1].prompt == [1, 2] and reqs[1].params == {"max_tokens": 9, "ignore_eos": True, "seed": 3}
    p.write_text('{"prompt": "x", "colour": 1}\n')
    with pytest.raises(ValueError, match="colour"):
        load_jsonl(str(p), 1)
    rnd = random_requests(50, 20, 8, range_ratio=0.5, token_range=(10, 20), seed=0)
    assert all(10 <= len(r.prompt) <= 30 and 4 <= r.params["max_tokens"] <= 12 for r in rnd)
    assert all(10 <= t < 20 for r in rnd for t in r.prompt)
    assert random_requests(3, 5, 5, seed=1)[0].prompt == random_requests(3, 5, 5, seed=1)[0].prompt


def test_cli_writes_vllm_fields(stub, tmp_path):
    from engine.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "run" / "result.json"
    rc = main(["bench", "serve", "--base-url", stub.url, "--dataset", str(data), "--num-prompts", "6",
               "--max-tokens", "4", "--request-rate", "50", "--max-concurrency", "2", "--percentiles", "50,95",
               "--goodput", "ttft:1000", "--no-progress", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
                "p95_tpot_ms", "p50_itl_ms", "p99_e2el_ms", "spec_decode", "requests"):
        assert key in r, key
    assert r["completed"] == 6 and r["total_output_tokens"] == 24 and r["max_concurrency"] == 2
    assert [x["request_id"] for x in r["requests"]] == ["q0", "q1", "q2", "q0#1", "q1#1", "q2#1"]
