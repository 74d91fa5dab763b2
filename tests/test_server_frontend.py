"""The HTTP front end on a fake engine (no model): protocol, SSE, errors, auth, overload, disconnects, death.

The fake follows the engine's streaming contract (add_request / abort_request / step -> deltas), so these run
in seconds; tests/test_server.py runs the same server on the built-in models.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from tests.helpers_server import FakeEngine, ThreadServer, fake_app, metric_value, wait_until


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(max_num_seqs=8, step_s=0.002)
    app, ae = fake_app(engine, max_queue=64)
    srv = ThreadServer(app)
    yield srv, engine, ae
    srv.stop()
    assert engine.shut_down  # the loop thread shut the engine down with the server


def _sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_completion_shapes_and_streamed_text_equals_non_streamed(fake) -> None:
    srv, _, _ = fake
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    full = client.completions.create(model="fake", prompt="hello", max_tokens=7)
    assert full.choices[0].text == "abcdefg" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens == 7 and full.usage.total_tokens == 12
    assert full.model_extra["spec_decode"] == {"rounds": 7, "drafted_tokens": 14, "accepted_tokens": 7,
                                               "mean_acceptance_length": 2.0}
    chunks = list(client.completions.create(model="fake", prompt="hello", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_token_ids_only_when_asked_for(fake) -> None:
    """vLLM's ``return_token_ids``: the output ids on each choice (each streamed chunk: that chunk's ids);
    without it a model with a tokenizer sends none (the response is OpenAI's)."""
    srv, _, _ = fake
    plain = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30).json()
    assert "token_ids" not in plain["choices"][0]
    body = {"prompt": "x", "max_tokens": 3, "return_token_ids": True}
    full = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
    assert full["choices"][0]["token_ids"] == [ord(c) for c in "abc"] and full["choices"][0]["text"] == "abc"
    r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    ids = [i for e in _sse_events(r.text)[:-1] for i in json.loads(e)["choices"][0]["token_ids"]]
    assert ids == full["choices"][0]["token_ids"]


def test_a_model_without_a_tokenizer_streams_its_token_ids_and_load_tests_time_them() -> None:
    """A model without a tokenizer has no text: its streams carried nothing until the last chunk, and
    ``bench serve`` / ``bench sweep`` reported no time to first token or per output token (every sweep of the
    larger random pair showed "-"). Now each chunk carries its token ids, and the load test times them."""
    import asyncio

    from benchmarks.openai_stream import RequestRecord, send_request

    engine = FakeEngine(max_num_seqs=2, step_s=0.02, text=False)
    app, _ = fake_app(engine, tokenizer=False)
    srv = ThreadServer(app)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True},
                       timeout=30)
        chunks = [json.loads(e)["choices"][0] for e in _sse_events(r.text)[:-1]]
        assert [c["token_ids"] for c in chunks] == [[97], [98], [99], [100]] and all(c["text"] == "" for c in chunks)
        full = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}, timeout=30).json()
        assert full["choices"][0]["token_ids"] == [97, 98, 99, 100]

        async def one() -> RequestRecord:
            async with httpx.AsyncClient(timeout=30) as client:
                rec = RequestRecord(index=0, request_id="0")
                return await send_request(client, srv.url + "/v1/completions",
                                          {"prompt": [1, 2], "max_tokens": 8, "stream": True,
                                           "stream_options": {"include_usage": True}}, rec, 0.0)

        rec = asyncio.run(one())
        assert rec.success and rec.output_tokens == 8
        assert rec.ttft is not None and 0 < rec.ttft < rec.e2el and rec.tpot is not None and len(rec.itl) == 7
    finally:
        srv.stop()


def test_sse_wire_format_ends_with_done(fake) -> None:
    srv, _, _ = fake
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]" and r.text.endswith("data: [DONE]\n\n")
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "abc"


def test_batch_of_prompts_and_token_ids(fake) -> None:
    srv, _, _ = fake
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}, timeout=30)
    body = r.json()
    assert r.status_code == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1] and all(c["text"] == "ab" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": ["ab", "cd", "ef"], "max_tokens": 4,
                                                      "stream": True}, timeout=30)
    texts: dict[int, str] = {}
    for e in _sse_events(r.text)[:-1]:
        c = json.loads(e)["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "abcd", 1: "abcd", 2: "abcd"}


def test_chat_streamed_and_not(fake) -> None:
    srv, _, _ = fake
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="fake", messages=msgs, max_tokens=4)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == "abcd"
    # The fake template: "system: be brief\nuser: hi\nassistant:" is 36 characters = tokens.
    assert full.usage.prompt_tokens == 36
    chunks = list(client.chat.completions.create(model="fake", messages=msgs, max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abcd"
    assert chunks[-1].choices[0].finish_reason == "length"
    # max_completion_tokens is OpenAI's newer name; with neither, chat runs to the end of the context.
    r = client.chat.completions.create(model="fake", messages=msgs, max_completion_tokens=2)
    assert r.choices[0].message.content == "ab"
    r = client.chat.completions.create(model="fake", messages=msgs)
    assert r.usage.completion_tokens == 64 - 36


def test_models_health_metrics(fake) -> None:
    srv, _, _ = fake
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["fake"]
    assert httpx.get(srv.url + "/health").status_code == 200
    text = httpx.get(srv.url + "/metrics").text
    for name in ("specserve:spec_decode_num_drafts_total", "specserve:spec_decode_num_draft_tokens_total",
                 "specserve:spec_decode_num_accepted_tokens_total", "specserve:num_requests_running",
                 "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc", "specserve:prompt_tokens_total",
                 "specserve:generation_tokens_total", "specserve:time_to_first_token_seconds_count",
                 "specserve:inter_token_latency_seconds_count", "specserve:e2e_request_latency_seconds_count"):
        assert metric_value(text, name) is not None, name
    assert metric_value(text, "specserve:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) > 0
    assert metric_value(text, "specserve:request_success_total", {"finished_reason": "length"}) > 0


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": -3}, "top_k", "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p", "[0, 1]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": 100}, "max_tokens", "context of 64"),
    ({"prompt": "y" * 80}, "prompt", "context is 64"),
    ({"prompt": [1, 500]}, "prompt", "vocabulary"),
    ({"prompt": []}, "prompt", "at least one"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", "valid number"),
    ({"prompt": "x", "seed": 2**64}, "seed", "seed"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": "x", "temprature": 0.5}, "temprature", "unknown field"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options", "include_usage"),
    ({"prompt": "x", "model": "gpt-4"}, "model", "does not exist"),
])
def test_bad_bodies_get_400_naming_the_field(fake, body, param, words) -> None:
    srv, _, _ = fake
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400), err
    assert err["param"] == param and param in err["message"] and words in err["message"], err


@pytest.mark.parametrize("field, value", [("best_of", 3), ("logit_bias", {"5": 1.0}),
                                          ("suffix", "x"), ("presence_penalty", 0.5),
                                          ("frequency_penalty", 1.0)])
def test_unsupported_completion_fields_are_refused(fake, field, value) -> None:
    srv, _, _ = fake
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", field: value}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and "supported" in err["message"], err
    # Their neutral values change nothing and are accepted (clients often send them).
    neutral = {"logprobs": None, "n": 1, "best_of": 1, "logit_bias": {}, "echo": False, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0.0}[field]
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, field: neutral}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x" * 70}]}, "messages"),
])
def test_bad_chat_bodies(fake, body, param) -> None:
    srv, _, _ = fake
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stream_disconnect_aborts_the_request(fake) -> None:
    srv, engine, ae = fake
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 60, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leave mid-stream: closing the response closes the connection
    wait_until(lambda: engine.aborted and not engine.running and ae.num_running == 0, what="abort after disconnect")
    text = httpx.get(srv.url + "/metrics").text
    assert metric_value(text, "specserve:num_requests_running") == 0
    assert metric_value(text, "specserve:request_success_total", {"finished_reason": "abort"}) >= 1


def test_non_streamed_disconnect_aborts_the_request(fake) -> None:
    srv, engine, ae = fake
    before = len(engine.aborted)
    body = json.dumps({"prompt": "x", "max_tokens": 60}).encode()
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: ae.num_running == 1, what="the request to run")
    wait_until(lambda: len(engine.aborted) > before and ae.num_running == 0, what="abort after disconnect")


def test_only_the_loop_thread_touches_the_engine(fake) -> None:
    _, engine, _ = fake
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids


def test_queue_bound_gives_429_with_retry_after() -> None:
    engine = FakeEngine(max_num_seqs=1, max_model_len=10_000, step_s=0.01)
    app, ae = fake_app(engine, max_queue=1)
    srv = ThreadServer(app)
    try:
        with httpx.Client(timeout=30) as client:
            long = {"prompt": "x", "max_tokens": 5000, "stream": True}  # runs ~50 s unless aborted
            with client.stream("POST", srv.url + "/v1/completions", json=long) as a:
                lines = a.iter_lines()  # kept: a dropped line iterator closes the response (a disconnect)
                next(lines)
                wait_until(lambda: ae.num_running == 1, what="A running")
                with client.stream("POST", srv.url + "/v1/completions", json=long) as b:
                    assert b.status_code == 200  # B waits for the running slot: the queue holds one
                    r = client.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                    assert r.json()["error"]["type"] == "RateLimitError"
                    text = client.get(srv.url + "/metrics").text
                    assert metric_value(text, "specserve:num_requests_waiting") == 1
                    assert metric_value(text, "specserve:request_errors_total", {"error": "overloaded"}) == 1
            wait_until(lambda: ae.num_unfinished == 0 and not engine.has_unfinished, what="both aborted")
            assert client.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        srv.stop()


def test_api_key_guards_v1_but_not_health_or_metrics() -> None:
    app, _ = fake_app(FakeEngine(), api_key="s3cret")
    srv = ThreadServer(app)
    try:
        url = srv.url
        body = {"prompt": "x", "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer s3cre"}).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"bad": 1}).status_code == 401  # before the body
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/docs").status_code == 401  # everything not listed open is guarded
        assert httpx.get(url + "/health").status_code == 200
        text = httpx.get(url + "/metrics").text
        assert metric_value(text, "specserve:request_errors_total", {"error": "unauthorized"}) == 5
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="fake", prompt="x", max_tokens=2).choices[0].text == "ab"
    finally:
        srv.stop()


def test_a_failed_step_fails_open_requests_and_health() -> None:
    engine = FakeEngine(step_s=0.01, fail_at_step=4)
    app, ae = fake_app(engine)
    srv = ThreadServer(app)
    try:
        # A stream that was running when the step failed ends with an error event (and no [DONE]).
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True},
                       timeout=30)
        events = _sse_events(r.text)
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "abc"
        assert "worker died" in json.loads(events[-1])["error"]["message"] and "[DONE]" not in r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=30)
        assert r.status_code == 503 and "worker died" in r.json()["error"]["message"]
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and "worker died" in h.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30)
        assert r.status_code == 503
        assert engine.shut_down
    finally:
        srv.stop()


def test_non_loopback_bind_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.server.auth import resolve_api_key

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert resolve_api_key("127.0.0.1", None) is None and resolve_api_key("::1", None) is None
    assert resolve_api_key("localhost", None) is None
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.com"):
        with pytest.raises(ValueError, match="--api-key"):
            resolve_api_key(host, None)
    assert resolve_api_key("0.0.0.0", "k") == "k"
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    assert resolve_api_key("0.0.0.0", None) == "from-env"


def test_serve_takes_the_engine_flags_of_generate() -> None:
    import argparse
    from dataclasses import fields

    from engine.core.args import EngineArgs
    from engine.server.cli import add_parser

    parser = argparse.ArgumentParser()
    serve = add_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--max-num-seqs", "3", "-tp", "2", "--speculative-config", "none",
                            "--port", "0", "--max-queue", "5"])
    args = EngineArgs.from_cli_args(ns)
    assert args.max_num_seqs == 3 and args.tensor_parallel_size == 2 and args.speculative_config == "none"
    assert (ns.port, ns.max_queue, ns.host) == (0, 5, "127.0.0.1")
    dests = {a.dest for a in serve._actions}
    assert {f.name for f in fields(EngineArgs)} <= dests
