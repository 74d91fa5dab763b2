"""The Batch API routes on the fake engine (no model, seconds): chat lines, the openai client's file and batch
calls, pagination, a full engine queue (429) retried by the runner, priorities reaching the engine."""

from __future__ import annotations

import io
import json

import openai
import pytest

from engine.jobs.store import JobStore
from engine.server.batches import batch_router
from tests.helpers_server import FakeEngine, FakeTokenizer, ThreadServer, fake_stats, wait_until


class PriorityEngine(FakeEngine):
    """The fake engine, also recording the priority each request arrived with."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.priorities: dict[str, int] = {}

    def add_request(self, request_id: str, prompt, params, priority: int = 0) -> None:
        super().add_request(request_id, prompt, params)
        self.priorities[request_id] = priority


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig

    engine = PriorityEngine(max_num_seqs=4, step_s=0.002)
    # max_queue 2 < the runner's 8 in flight: the engine answers 429 and the runner must retry.
    ae = AsyncEngine(engine, max_queue=2, metrics=ServerMetrics("fake"), stats_reader=fake_stats)
    store = JobStore(tmp_path_factory.mktemp("batch-frontend"))
    app = build_app(ae, ServerConfig("fake"), FakeTokenizer(),
                    extra_routers=[batch_router(store, max_in_flight=8, poll_s=0.05, retry_s=0.05)])
    srv = ThreadServer(app)
    yield srv, engine
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _upload(c: openai.OpenAI, rows: list[dict]) -> str:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def test_chat_job_through_a_full_queue_at_batch_priority(server) -> None:
    srv, engine = server
    c = _client(srv)
    n = 30
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "fake", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 1 + i % 4}}
            for i in range(n)]
    rows.append({"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "x"}], "stream": True}})
    fid = _upload(c, rows)
    b = c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="still running"):
        c.files.delete(fid)
    online = c.completions.create(model="fake", prompt="hi", max_tokens=3)  # online traffic meanwhile
    assert online.choices[0].text == "abc"
    done = wait_until(lambda: (r := c.batches.retrieve(b.id)).status == "completed" and r, timeout_s=60)
    assert done.request_counts.completed == n and done.request_counts.failed == 1
    out = [json.loads(ln) for ln in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(n))
    for r in out:
        body = r["response"]["body"]
        i = int(r["custom_id"][1:])
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "abcd"[:1 + i % 4]
    (err,) = [json.loads(ln) for ln in c.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "streamed" and "stream: not supported in a batch" in \
        err["response"]["body"]["error"]["message"]
    batch_ids = [rid for rid in engine.priorities if rid.startswith("chatcmpl-")]
    assert len(batch_ids) >= n and all(engine.priorities[rid] == 1 for rid in batch_ids)
    assert [p for rid, p in engine.priorities.items() if rid.startswith("cmpl-")] == [0]
    assert c.files.delete(fid).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(fid)


def test_openai_client_lists_pages_and_reports_failed_validation(server) -> None:
    srv, _ = server
    c = _client(srv)
    fid = _upload(c, [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
                      {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}])
    ids = [c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id
           for _ in range(3)]
    failed = wait_until(lambda: (r := c.batches.retrieve(ids[0])).status == "failed" and r, timeout_s=30)
    assert failed.errors.data[0].code == "duplicate_custom_id" and failed.errors.data[0].line == 2
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert page.get_next_page().data[0].id == ids[0]  # the client follows ?after=last_id
    assert {b.id for b in c.batches.list(limit=2)} >= set(ids)  # iterating a page walks every page
    assert c.files.retrieve(fid).purpose == "batch" and fid in [f.id for f in c.files.list()]
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        c.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
