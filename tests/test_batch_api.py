"""The Batch API end to end on the real server and the built-in pair (issue 12's done-when tests).

One data directory, three server lives on one port: a 300-request job submitted with the official ``openai``
client survives ``kill -9`` of the server; a second job, watched by the Python client and by
``specserve batch wait`` in another process, survives the next ``kill -9`` (both wait by retrying); then a job
with bad lines mixed in, and a cancelled one. Greedy results are compared with the offline engine (an
uninterrupted run of the same requests). Small max_tokens and a small running set keep it to about a minute of
engine time.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from tests.helpers_server import REPO, SubprocessServer

pytestmark = pytest.mark.slow  # `specserve serve` subprocesses killed and restarted

MODEL = "specserve-default"
EP = "/v1/completions"
# The shipped prompts' first 40 characters: short prompts keep prefill (most of the CPU time) small.
SHIPPED = [json.loads(ln)["prompt"][:40] for ln in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()]


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": SHIPPED[i % len(SHIPPED)], "max_tokens": 3 + i % 3, "temperature": 0}


def _lines(n: int, prefix: str) -> list[str]:
    return [json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": EP, "body": _body(i)}) for i in range(n)]


@pytest.fixture(scope="module")
def reference() -> dict[int, str]:
    """Greedy text of request i from the offline engine: what an uninterrupted run produces."""
    from engine import LLM, SamplingParams

    with LLM() as llm:
        outs = llm.generate([SHIPPED[i % len(SHIPPED)] for i in range(len(SHIPPED) * 3)],
                            [SamplingParams(max_tokens=3 + i % 3, temperature=0) for i in range(len(SHIPPED) * 3)])
    return {i: o.text for i, o in enumerate(outs)}


def _ref_index(i: int) -> int:
    # Request i has prompt i % 64 and max_tokens 3 + i % 3: the reference entry with the same pair.
    n = len(SHIPPED)
    for j in range(n * 3):
        if j % n == i % n and j % 3 == i % 3:
            return j
    raise AssertionError(i)


class Life:
    """The server on a fixed port and data directory, restartable."""

    def __init__(self, data_dir: Path) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.data_dir = data_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: SubprocessServer | None = None

    def start(self) -> None:
        self.server = SubprocessServer("--port", str(self.port), "--data-dir", str(self.data_dir),
                                       "--max-num-seqs", "16")
        assert self.server.url == self.url

    def kill9(self) -> None:
        self.server.proc.send_signal(signal.SIGKILL)
        self.server.proc.wait(30)

    def done_rows(self, batch_id: str) -> int:
        with sqlite3.connect(self.data_dir / "jobs.sqlite3") as db:
            return db.execute("SELECT count(*) FROM requests WHERE batch_id = ? AND state != 'pending'",
                              (batch_id,)).fetchone()[0]


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory):
    life = Life(tmp_path_factory.mktemp("batch-data"))
    life.start()
    yield life
    if life.server is not None:
        life.server.stop()


def _poll(cond, timeout_s: float = 180.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every_s)


def test_openai_client_job_survives_kill_9(life: Life, reference: dict[int, str]) -> None:
    from openai import OpenAI

    n = 300
    c = OpenAI(base_url=life.url + "/v1", api_key="unused", max_retries=0)
    f = c.files.create(file=("in.jsonl", io.BytesIO(("\n".join(_lines(n, "a")) + "\n").encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=EP, completion_window="24h", metadata={"test": "kill"})
    assert b.status == "validating" and b.metadata == {"test": "kill"}
    _poll(lambda: c.batches.retrieve(b.id).request_counts.completed >= 40)
    life.kill9()
    done_at_kill = life.done_rows(b.id)
    assert 40 <= done_at_kill < n, done_at_kill  # killed mid-job

    life.start()  # same data dir: the job resumes on its own
    final = _poll(lambda: (r := c.batches.retrieve(b.id)).status in ("completed", "failed") and r)
    assert final.status == "completed", final
    assert final.request_counts.total == n and final.request_counts.completed == n and final.request_counts.failed == 0
    assert final.error_file_id is None
    rows = [json.loads(ln) for ln in c.files.content(final.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"a{i}" for i in range(n))  # each exactly once
    for r in rows:
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["body"]["object"] == "text_completion"
        i = int(r["custom_id"][1:])
        assert r["response"]["body"]["choices"][0]["text"] == reference[_ref_index(i)], i
    assert b.id in [x.id for x in c.batches.list(limit=10)]


def test_python_client_and_cli_wait_survive_kill_9(life: Life, reference: dict[int, str], tmp_path: Path) -> None:
    from engine.client import Client

    n = 200
    client = Client(life.url, retry_timeout_s=240)
    job = client.submit_batch([_body(i) for i in range(n)])  # bare bodies: custom_id is the position
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli_wait = subprocess.Popen([sys.executable, "-m", "engine.cli", "batch", "--url", life.url, "wait", job.id,
                                 "--poll", "0.2", "--no-progress"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    waited: dict = {}
    t = threading.Thread(target=lambda: waited.update(job.wait(poll_s=0.2)), daemon=True)
    t.start()
    try:
        _poll(lambda: job.status()["request_counts"]["completed"] >= 20)
        life.kill9()
        assert life.done_rows(job.id) < n
        time.sleep(1.0)  # both waiters now meet a refused connection and retry
        life.start()
        t.join(240)
        out, err = cli_wait.communicate(timeout=240)
    finally:
        cli_wait.kill()
    assert waited["status"] == "completed" and waited["request_counts"]["completed"] == n
    assert cli_wait.returncode == 0, err[-2000:]
    assert json.loads(out)["status"] == "completed"

    got = dict(job.results())
    assert sorted(got, key=int) == [str(i) for i in range(n)] and list(job.errors()) == []
    assert all(got[str(i)]["choices"][0]["text"] == reference[_ref_index(i)] for i in range(n))
    res = tmp_path / "res.jsonl"
    cp = subprocess.run([sys.executable, "-m", "engine.cli", "batch", "--url", life.url, "results", job.id, "-o",
                         str(res)], env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert sorted(json.loads(ln)["custom_id"] for ln in res.read_text().splitlines()) == sorted(got)
    assert job.id in [j.id for j in client.jobs(limit=5)]


def test_bad_lines_go_to_the_error_file_named(life: Life) -> None:
    from engine.client import Client, RequestError

    good = _lines(6, "g")
    bad = {
        "zero": json.dumps({"custom_id": "zero", "method": "POST", "url": EP, "body": {**_body(0), "max_tokens": 0}}),
        "unknown": json.dumps({"custom_id": "unknown", "method": "POST", "url": EP,
                               "body": {**_body(0), "temprature": 1}}),
        "topk": json.dumps({"custom_id": "topk", "method": "POST", "url": EP,
                            "body": {**_body(0), "top_k": 2 ** 63}}),
        "url": json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": _body(0)}),
        "surrogate": json.dumps({"custom_id": "surrogate", "method": "POST", "url": EP,
                                 "body": {**_body(0), "prompt": "a\ud800"}}),
    }
    raw = "\n".join(good[:3] + list(bad.values()) + ["{broken"] + good[3:]).encode() + b"\n\xff\xfe{}\n"
    path = Path(life.data_dir).parent / "mixed.jsonl"
    path.write_bytes(raw)
    client = Client(life.url)
    done = client.submit_batch(path).wait(poll_s=0.2, timeout_s=120)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 13, "completed": 6, "failed": 7}
    job = client.job(done["id"])
    assert sorted(cid for cid, _ in job.results()) == sorted(f"g{i}" for i in range(6))
    errors = list(job.errors())
    by_id = {cid: e for cid, e in errors if cid is not None}
    assert "max_tokens" in by_id["zero"]["message"]
    assert "temprature" in by_id["unknown"]["message"]
    assert "top_k" in by_id["topk"]["message"]
    assert "url must be the batch's endpoint" in by_id["url"]["message"]
    assert "not valid Unicode" in by_id["surrogate"]["message"]
    anonymous = {e["message"].split(":")[0]: e["message"] for cid, e in errors if cid is None}
    assert anonymous["line 9"].startswith("line 9: Expecting property name")
    assert anonymous["line 13"].startswith("line 13: not valid UTF-8")
    with pytest.raises(RequestError, match="no batch with id"):
        client.job("batch_nope").status()


def test_cancel_mid_job_keeps_partial_output(life: Life) -> None:
    from openai import OpenAI

    n = 150
    c = OpenAI(base_url=life.url + "/v1", api_key="unused", max_retries=0)
    f = c.files.create(file=("c.jsonl", io.BytesIO(("\n".join(_lines(n, "c")) + "\n").encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=EP, completion_window="24h")
    _poll(lambda: c.batches.retrieve(b.id).request_counts.completed >= 10)
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    final = _poll(lambda: (r := c.batches.retrieve(b.id)).status == "cancelled" and r, timeout_s=60)
    done = final.request_counts.completed
    assert 10 <= done < n and final.cancelled_at is not None
    rows = [json.loads(ln) for ln in c.files.content(final.output_file_id).text.splitlines()]
    assert len(rows) == done and len({r["custom_id"] for r in rows}) == done
