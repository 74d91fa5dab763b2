"""Fuzz ``specserve serve`` (built-in pair) with hypothesis: request bodies, raw bytes and headers.

Whatever arrives, the answer is never a 5xx, the engine stays alive, and the server still serves a normal
request afterwards. Generation stays short: every body the strategies can make valid asks for <= 8 tokens.
The front door's limits run small here (a 64 KiB body, 1 s for headers, 2 s for a body) so bodies around the
limit and requests cut off anywhere are cheap to try: 413 exactly past the limit, a cut-off request dropped in
time.
"""

from __future__ import annotations

import json
import socket
import string
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers_server import SubprocessServer

pytestmark = pytest.mark.slow  # a `specserve serve` subprocess on the built-in pair

MODEL = "specserve-default"
STATUSES: Counter[int] = Counter()  # over the whole module: the fuzz must reach the engine, not only the parser

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                     max_size=3), max_leaves=8)
_DELETE = object()


def _mostly(valid: st.SearchStrategy, *edges: object) -> st.SearchStrategy:
    """Valid four times in five; otherwise a value at or past the edge of the range (right type, wrong value)."""
    return st.one_of(valid, valid, valid, valid, st.sampled_from(edges))


INT64 = (2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64)
NONFINITE = (float("nan"), float("inf"), -float("inf"))
token_ids = _mostly(st.lists(st.integers(0, 4095), min_size=1, max_size=6), [], [-1], [4096], [2**64])
# Mostly valid bodies (so the fuzz reaches the engine), each with up to two fields replaced by anything at all,
# deleted, or added.
sampling = {
    "temperature": _mostly(st.floats(0, 2), -1, -1e-9, 1e308, *NONFINITE),
    "top_p": _mostly(st.floats(0.01, 1), 0, -0.5, 1.0000001, 2, *NONFINITE),
    "top_k": _mostly(st.integers(-1, 100), 0, -2, 4096, *INT64),
    "min_p": _mostly(st.floats(0, 1), -0.1, 1.5, *NONFINITE),
    "seed": _mostly(st.integers(-(2**63), 2**63 - 1), *INT64),
    "stop": _mostly(st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3), "",
                    [""]),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 4095), max_size=3), [-1], [2**64], [4096]),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": _mostly(st.just(1) | st.just(2), 0, -1, 17, 2**64),
    "logprobs": _mostly(st.none() | st.integers(0, 3), -1, 21, 2**64, True),
    "user": st.text(max_size=8),
}
FIELDS = sorted({*sampling, "model", "prompt", "max_tokens", "messages", "max_completion_tokens", "best_of", "echo",
                 "suffix", "logit_bias", "presence_penalty", "tools", "response_format", "stream_options",
                 "return_token_ids", "top_logprobs", "logprobs_mode", "structured_outputs", "guided_json",
                 "guided_regex", "guided_choice", "guided_grammar"})
mutations = st.lists(st.tuples(st.sampled_from(FIELDS) | st.text(max_size=8),
                               anything | st.integers(-(2**70), 2**70) | st.just(_DELETE)), max_size=2)


def _mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    def apply(args: tuple[dict, list]) -> dict:
        body, muts = args
        body = dict(body)
        for key, value in muts:
            if key in ("max_tokens", "max_completion_tokens"):
                # Keep generation short: a missing limit means the rest of the context in chat, and a valid
                # large one runs long; push large ones past the context (a 400) instead.
                if value is _DELETE:
                    continue
                if type(value) is int and value > 8:
                    value += 600
            if value is _DELETE:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    return st.tuples(valid, mutations).map(apply)


prompts = (st.text(max_size=40) | token_ids | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3)
           | st.lists(token_ids, min_size=1, max_size=3))
completion_bodies = _mutated(st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": prompts, "max_tokens": _mostly(st.integers(1, 8), 0, -1, 600, 2**64)},
    optional=sampling))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2)})
chat_bodies = _mutated(st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=3),
     "max_tokens": _mostly(st.integers(1, 8), 0, -1, 600, 2**64)}, optional=sampling))
extra_keys = st.dictionaries(st.text(max_size=8), anything, max_size=2)
# Header values a client can send at all (h11 refuses leading/trailing blanks before they leave).
header_text = st.text(alphabet=string.ascii_letters + string.digits + " -_.=/+:;,", max_size=40).map(str.strip)
headers = st.dictionaries(st.sampled_from(["authorization", "content-type", "accept", "x-request-id",
                                           "content-encoding", "transfer-encoding-x"]), header_text, max_size=3)


MAX_BODY, HEADER_TIMEOUT, BODY_TIMEOUT = 65536, 1.0, 2.0


@pytest.fixture(scope="module")
def server():
    srv = SubprocessServer("--max-body-bytes", str(MAX_BODY), "--header-timeout", str(HEADER_TIMEOUT),
                           "--body-timeout", str(BODY_TIMEOUT), env={"OMP_NUM_THREADS": "1"})
    yield srv
    assert srv.stop() in (0, -15), srv.stderr[-3000:]


def _send(http: httpx.Client, method: str, path: str, hdrs: dict[str, str], **kw) -> httpx.Response:
    if "json" in kw:  # NaN and Infinity too (Python's JSON reads them; a server must refuse them cleanly)
        kw["content"] = json.dumps(kw.pop("json")).encode()
        hdrs = {"content-type": "application/json", **hdrs}
    r = http.request(method, path, headers=hdrs, **kw)
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, (method, path, hdrs, kw, r.status_code, r.text[:500])
    return r


_fuzz = settings(max_examples=50, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_fuzz
@given(body=completion_bodies, extra=extra_keys, hdrs=headers)
def test_fuzz_completions(server, body, extra, hdrs) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _send(http, "POST", "/v1/completions", hdrs, json={**body, **extra} if extra else body)


@_fuzz
@given(body=chat_bodies, extra=extra_keys, hdrs=headers)
def test_fuzz_chat(server, body, extra, hdrs) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _send(http, "POST", "/v1/chat/completions", hdrs, json={**body, **extra} if extra else body)


# Every field at each of its edges, alone in an otherwise valid body (greedy and sampled, streamed or not):
# the value check, not a failed engine step, must answer.
EDGES = [(k, v) for k, values in {
    "temperature": (-1, 1e308, *NONFINITE), "top_p": (0, 1.0000001, *NONFINITE), "top_k": (0, -2, 4096, *INT64),
    "min_p": (-0.1, 1.5, float("nan")), "seed": INT64, "stop_token_ids": ([-1], [2**64]),
    "max_tokens": (0, 600, 2**64), "prompt": ([], [-1], [4096], [2**64], [[]], "", "\x00" * 3)}.items() for v in values]


@_fuzz
@given(edge=st.sampled_from(EDGES), chat=st.booleans(), stream=st.booleans(), temperature=st.sampled_from([0, 0.7]))
def test_fuzz_edges(server, edge, chat, stream, temperature) -> None:
    key, value = edge
    body = {"model": MODEL, "max_tokens": 2, "temperature": temperature, "stream": stream, key: value}
    path = "/v1/completions"
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": value if key == "prompt" else "x"}]
        body.pop("prompt", None)
    else:
        body.setdefault("prompt", "def f():")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _send(http, "POST", path, {}, json=body)


@_fuzz
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                             "/v1", "/", "/v1/completions/x"]) | st.text(alphabet=string.ascii_letters + "/._-%",
                                                                          max_size=20).map(lambda s: "/" + s),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"]),
       raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode), hdrs=headers)
def test_fuzz_raw_requests(server, path, method, raw, hdrs) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _send(http, method, path, hdrs, content=raw)


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 3 * MAX_BODY) | st.sampled_from([MAX_BODY - 1, MAX_BODY, MAX_BODY + 1]),
       chunked=st.booleans(), chunk=st.integers(1, 50000), path=st.sampled_from(["/v1/completions", "/health"]))
def test_fuzz_body_sizes(server, size, chunked, chunk, path) -> None:
    """A JSON body of any size, declared or streamed in chunks: 413 exactly when it passes the limit (an
    endpoint that never reads its body may answer before it is counted, and then closes the connection)."""
    prefix, suffix = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "prompt": "', b'"}'
    body = prefix + b"x" * max(0, size - len(prefix) - len(suffix)) + suffix
    content = (body[i:i + chunk] for i in range(0, len(body), chunk)) if chunked else body
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = _send(http, "POST", path, {"content-type": "application/json"}, content=content)
    if path == "/v1/completions":
        assert (r.status_code == 413) == (len(body) > MAX_BODY), (len(body), r.status_code, r.text[:200])
    if r.status_code == 413:
        assert f"--max-body-bytes={MAX_BODY}" in r.json()["error"]["message"]


def _valid_request() -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "def f():", "max_tokens": 1}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cut=st.integers(1, len(_valid_request()) - 1))
def test_fuzz_cut_off_requests_are_dropped_in_time(server, cut) -> None:
    """A valid request cut off anywhere (in the request line, the headers or the body): the server closes the
    connection within the header or body timeout, answering 408 or nothing, never holding it."""
    raw = _valid_request()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw[:cut])
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        took = time.monotonic() - t0
    assert took < HEADER_TIMEOUT + BODY_TIMEOUT + 2, (cut, took)
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), (cut, got[:200])


def test_server_still_answers_after_the_fuzz(server) -> None:
    assert STATUSES[200] > 0 and STATUSES[400] > 0, STATUSES
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "def f():", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
