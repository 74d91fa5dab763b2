"""The durable batch store and its runner (issue 12), with a deterministic stand-in for the engine.

The real engine runs the same code in tests/test_batch_api.py; here the store's semantics are pinned quickly:
validation line by line, exactly-once results across a crash, cancel and expiry keeping partial output.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from engine.jobs.runner import BatchRunner, RetryLater
from engine.jobs.store import InvalidRequestError, JobStore

EP = "/v1/completions"


class FakeExecutor:
    """Completes a prompt with the prompt reversed; a body with "fail" answers 400; "slow" waits forever."""

    def __init__(self, gate: asyncio.Event | None = None, retry_first: int = 0) -> None:
        self.gate = gate
        self.calls: list[str] = []
        self.retry_first = retry_first

    async def execute(self, endpoint: str, body: dict, request_id: str) -> tuple[int, dict]:
        if self.retry_first > 0:
            self.retry_first -= 1
            raise RetryLater
        self.calls.append(body["prompt"])
        if self.gate is not None and body["prompt"].startswith("slow"):
            await self.gate.wait()
        await asyncio.sleep(0)
        if "fail" in body:
            return 400, {"error": {"message": "max_tokens must be >= 1, got 0", "type": "BadRequestError",
                                   "param": "max_tokens", "code": 400}}
        return 200, {"object": "text_completion", "choices": [{"index": 0, "text": body["prompt"][::-1],
                                                               "finish_reason": "length"}]}


def _line(cid: str | None, prompt: str, **body) -> bytes:
    d = {"method": "POST", "url": EP, "body": {"prompt": prompt, **body}}
    if cid is not None:
        d["custom_id"] = cid
    return json.dumps(d, ensure_ascii=False).encode()


def _upload(store: JobStore, lines: list[bytes], bom: bool = False) -> str:
    data = (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines) + b"\n"
    return store.create_file(io.BytesIO(data), "in.jsonl", "batch")["id"]


def _rows(store: JobStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(ln) for ln in b"".join(store.iter_file(file_id)).decode().splitlines()]


async def _until(cond, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_validation_keeps_each_lines_problem_to_that_line(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    fid = _upload(store, [
        _line("a", "x\u2028y\u0085z"),  # separators inside a string: one line, not three
        b'{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}',
        b"[" * 50_000,
        b"",
        _line("c", "ok", max_tokens=2).replace(b'"url": "/v1/completions"', b'"url": "/v1/embeddings"'),
        b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": [1]}',
        b"{not json",
        _line("e", "fine"),
    ], bom=True)
    b = store.create_batch(fid, EP)
    b = store.validate(b["id"])
    assert b["status"] == "in_progress" and b["request_counts"] == {"total": 7, "completed": 0, "failed": 5}

    async def go() -> dict:
        runner = BatchRunner(store, FakeExecutor(), poll_s=0.05)
        runner.start()
        await _until(lambda: store.get_batch(b["id"])["status"] == "completed")
        await runner.stop()
        return store.get_batch(b["id"])

    done = _run(go())
    assert done["request_counts"] == {"total": 7, "completed": 2, "failed": 5}
    out = _rows(store, done["output_file_id"])
    assert [(r["custom_id"], r["response"]["body"]["choices"][0]["text"]) for r in out] == [
        ("a", "z\u0085y\u2028x"), ("e", "enif")]
    assert all(set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
               and r["response"]["status_code"] == 200 for r in out)
    errs = {r["error"]["message"] if r["error"] else r["response"]["body"]["error"]["message"]: r
            for r in _rows(store, done["error_file_id"])}
    msgs = sorted(errs)
    assert any(m.startswith("line 2: not valid UTF-8") for m in msgs)
    assert any(m.startswith("line 3: JSON nested too deeply") for m in msgs)
    assert any(m.startswith("line 5: url must be the batch's endpoint") for m in msgs)
    assert any(m.startswith("line 6: body must be a JSON object") for m in msgs)
    assert any(m.startswith("line 7: Expecting property name") for m in msgs)


@pytest.mark.parametrize(("lines", "code", "message"), [
    ([_line("a", "x"), _line("b", "y"), _line("a", "z")], "duplicate_custom_id", "'a' appears on lines 1, 3"),
    ([_line("a", "x"), _line(None, "y")], "missing_custom_id", "line 2: 'custom_id' is required"),
    ([b"", b"  "], "empty_file", "no requests"),
])
def test_validation_failures_name_the_lines(tmp_path: Path, lines, code: str, message: str) -> None:
    store = JobStore(tmp_path)
    b = store.validate(store.create_batch(_upload(store, lines), EP)["id"])
    assert b["status"] == "failed" and b["failed_at"] is not None
    (err,) = b["errors"]["data"]
    assert err["code"] == code and message in err["message"]


def test_bad_requests_to_the_store_are_refused_by_name(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    fid = _upload(store, [_line("a", "x")])
    with pytest.raises(InvalidRequestError, match="endpoint: must be one of"):
        store.create_batch(fid, "/v1/embeddings")
    with pytest.raises(InvalidRequestError, match="completion_window"):
        store.create_batch(fid, EP, "1h")
    with pytest.raises(InvalidRequestError, match="input_file_id: no file"):
        store.create_batch("file-nope", EP)
    with pytest.raises(InvalidRequestError, match="purpose"):
        store.create_file(io.BytesIO(b"x"), "f", "fine-tune")


def test_a_crash_mid_job_resumes_with_every_request_exactly_once(tmp_path: Path) -> None:
    n = 60
    store = JobStore(tmp_path)
    lines = [_line(f"r{i}", ("slow" if i >= 25 else "") + f"p{i}") for i in range(n)]
    bid = store.create_batch(_upload(store, lines), EP)["id"]

    async def first_life() -> None:
        # Requests 25.. block: the process "dies" with 25 recorded and max_in_flight more in flight.
        runner = BatchRunner(store, FakeExecutor(gate=asyncio.Event()), max_in_flight=8, poll_s=0.05)
        runner.start()
        await _until(lambda: store.get_batch(bid)["request_counts"]["completed"] == 25 and runner.in_flight == 8)
        await runner.stop()  # what a kill leaves: in-flight requests never recorded

    _run(first_life())
    assert store.get_batch(bid)["status"] == "in_progress"
    store.close()

    store2 = JobStore(tmp_path)  # a new process on the same data directory
    ex = FakeExecutor()

    async def second_life() -> dict:
        runner = BatchRunner(store2, ex, max_in_flight=8, poll_s=0.05)
        runner.start()
        await _until(lambda: store2.get_batch(bid)["status"] == "completed")
        await runner.stop()
        return store2.get_batch(bid)

    done = _run(second_life())
    assert sorted(ex.calls) == sorted(f"slowp{i}" for i in range(25, n))  # finished ones did not run again
    out = _rows(store2, done["output_file_id"])
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(n)]  # each exactly once, in input order
    assert [r["response"]["body"]["choices"][0]["text"] for r in out] == [
        (("slow" if i >= 25 else "") + f"p{i}")[::-1] for i in range(n)]
    assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}


def test_a_result_is_never_counted_twice(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    bid = store.create_batch(_upload(store, [_line("a", "x")]), EP)["id"]
    store.validate(bid)
    assert store.record(bid, [(0, True, {"custom_id": "a"})]) == 1
    assert store.record(bid, [(0, True, {"custom_id": "a"})]) == 0
    assert store.get_batch(bid)["request_counts"]["completed"] == 1


def test_cancel_mid_job_keeps_the_finished_part(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    lines = [_line(f"r{i}", ("slow" if i >= 10 else "") + f"p{i}", **({"fail": 1} if i == 3 else {}))
             for i in range(30)]
    bid = store.create_batch(_upload(store, lines), EP)["id"]

    async def go() -> dict:
        runner = BatchRunner(store, FakeExecutor(gate=asyncio.Event()), max_in_flight=4, poll_s=0.05)
        runner.start()
        await _until(lambda: store.get_batch(bid)["request_counts"]["completed"] == 9)
        assert store.cancel_batch(bid)["status"] == "cancelling"
        runner.wake()
        await _until(lambda: store.get_batch(bid)["status"] == "cancelled")
        await runner.stop()
        return store.get_batch(bid)

    done = _run(go())
    assert done["cancelled_at"] is not None and done["request_counts"] == {"total": 30, "completed": 9, "failed": 1}
    assert [r["custom_id"] for r in _rows(store, done["output_file_id"])] == [f"r{i}" for i in range(10) if i != 3]
    (err,) = _rows(store, done["error_file_id"])
    assert err["custom_id"] == "r3" and err["response"]["status_code"] == 400
    bid2 = store.create_batch(_upload(store, [_line("z", "z")]), EP)["id"]
    store.validate(bid2)
    store.record(bid2, [(0, True, {"custom_id": "z"})])
    assert store.finalize(bid2)["status"] == "completed"
    with pytest.raises(InvalidRequestError, match="only a validating or in_progress batch"):
        store.cancel_batch(bid2)


def test_an_expired_batch_lists_what_did_not_run(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    bid = store.create_batch(_upload(store, [_line(f"r{i}", f"p{i}") for i in range(3)]), EP)["id"]
    store.validate(bid)
    store.record(bid, [(0, True, {"custom_id": "r0"})])
    with store._tx() as db:
        db.execute("UPDATE batches SET expires_at = 1 WHERE id = ?", (bid,))

    async def go() -> dict:
        runner = BatchRunner(store, FakeExecutor(), poll_s=0.05)
        runner.start()
        await _until(lambda: store.get_batch(bid)["status"] == "expired")
        await runner.stop()
        return store.get_batch(bid)

    done = _run(go())
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [(r["custom_id"], r["error"]["code"]) for r in _rows(store, done["error_file_id"])] == [
        ("r1", "batch_expired"), ("r2", "batch_expired")]


def test_retry_later_leaves_requests_pending_until_the_engine_takes_them(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    bid = store.create_batch(_upload(store, [_line(f"r{i}", f"p{i}") for i in range(5)]), EP)["id"]

    async def go() -> dict:
        runner = BatchRunner(store, FakeExecutor(retry_first=3), poll_s=0.05, retry_s=0.05)
        runner.start()
        await _until(lambda: store.get_batch(bid)["status"] == "completed")
        await runner.stop()
        return store.get_batch(bid)

    done = _run(go())
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert [r["custom_id"] for r in _rows(store, done["output_file_id"])] == [f"r{i}" for i in range(5)]


def test_list_paginates_newest_first_and_files_can_be_deleted(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    fid = _upload(store, [_line("a", "x")])
    ids = [store.create_batch(fid, EP)["id"] for _ in range(5)]
    page, more = store.list_batches(limit=2)
    assert [b["id"] for b in page] == ids[::-1][:2] and more
    page, more = store.list_batches(limit=10, after=page[-1]["id"])
    assert [b["id"] for b in page] == ids[::-1][2:] and not more
    with pytest.raises(InvalidRequestError, match="still running"):
        store.delete_file(fid)


def test_one_server_per_data_directory(tmp_path: Path) -> None:
    """A second server on a data directory in use is refused by name (both would run its jobs); a dead one frees it."""
    import os
    import subprocess
    import sys

    first = JobStore(tmp_path)
    first.claim()
    second = JobStore(tmp_path)
    with pytest.raises(RuntimeError, match=rf"--data-dir .* in use by another specserve server \(pid {os.getpid()}\)"):
        second.claim()
    # The CLI refuses before any model loads: a clean one-line error, exit 2, no traceback.
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "in use by another specserve server" in proc.stderr and "Traceback" not in proc.stderr
    os.close(first._lock_fd)  # the holder's process ends: the OS drops its lock
    second.claim()
