"""Errors that say where and why (issue 48, item 8): ``top_k`` 0 is "off"; a top_k past the vocabulary is
refused naming the vocabulary size; a batch line's bad field names its line; ``specserve generate`` names an
unreadable line by its 1-based line number."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest

from engine.jobs.generate import parse_line
from engine.jobs.jsonl import iter_lines
from engine.jobs.store import JobStore
from tests.helpers_server import FakeEngine, FakeTokenizer, ThreadServer, fake_stats, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.batches import batch_router
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig

    ae = AsyncEngine(FakeEngine(max_num_seqs=4), metrics=ServerMetrics("fake"), stats_reader=fake_stats)
    store = JobStore(tmp_path_factory.mktemp("request-errors"))
    app = build_app(ae, ServerConfig("fake"), FakeTokenizer(),
                    extra_routers=[batch_router(store, max_in_flight=4, poll_s=0.05, retry_s=0.05)])
    srv = ThreadServer(app)
    yield srv
    srv.stop()


def test_top_k_zero_is_off_and_the_limit_is_the_vocabulary(server) -> None:
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "top_k": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text
    for top_k in (129, 2**40, 2**63):
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "top_k": top_k}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "top_k", r.text
        assert "between 1 and the vocabulary size, 128" in err["message"] and "2147483647" not in err["message"]


def test_a_batch_line_with_a_bad_field_names_its_line(server) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "x", "max_tokens": 1, "temperature": -1 if i == 2 else 0}} for i in range(4)]
    data = "".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n" + "".join(json.dumps(r) + "\n" for r in rows[2:])
    fid = c.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id
    bid = c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id
    batch = wait_until(lambda: (b := c.batches.retrieve(bid)).status == "completed" and b, timeout_s=60,
                       what="the batch")
    (err,) = [json.loads(ln) for ln in c.files.content(batch.error_file_id).text.splitlines()]
    message = err["response"]["body"]["error"]["message"]
    assert err["custom_id"] == "r2" and message.startswith("line 4: temperature"), message  # line 3 is blank


def test_an_unreadable_generate_line_is_known_by_its_line_number() -> None:
    raw = b'{"id": "a", "prompt": "x"}\n\n{"prompt": "y"}\n{not json\n\xff\xfe\n{"prompt": "z", "top_k": -3}\n'
    lines = [ln for ln in iter_lines(io.BytesIO(raw)) if not ln.blank]
    parsed = [parse_line(i, ln, {}) for i, ln in enumerate(lines)]
    assert [p.request_id for p in parsed] == ["a", "3", "4", "5", "6"]
    assert parsed[2].error.startswith("line 4: malformed JSON") and parsed[3].error.startswith("line 5: not valid")
    assert parsed[4].error.startswith("line 6: top_k must be -1 or 0 (off)")
    assert parsed[1].error is None and parse_line(0, '{"prompt": "q", "top_k": 0}', {}).params.top_k == -1
