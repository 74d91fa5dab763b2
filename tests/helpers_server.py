"""Servers for the HTTP tests: the real ``specserve serve`` in a subprocess, or an app in a uvicorn thread; and
a small fake engine that follows the engine's streaming contract (add_request / abort_request / step -> deltas),
for front-end tests that must not wait on a model.

Every wait here has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class SubprocessServer:
    """``python -m engine.cli serve --port 0 ...``; the URL comes from its one stdout line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout_s: float = 240.0) -> None:
        # Never the user's own job store: a server a test starts keeps its batch jobs in a private folder.
        self._data_dir = None if "--data-dir" in args else tempfile.mkdtemp(prefix="specserve-test-")
        extra = ["--data-dir", self._data_dir] if self._data_dir else []
        cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args, *extra]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in self.proc.stdout], daemon=True).start()
        self._stderr: list[str] = []
        threading.Thread(target=lambda: [self._stderr.append(ln) for ln in self.proc.stderr], daemon=True).start()
        try:
            line = lines.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"server did not start in {start_timeout_s}s: {self.stderr[-3000:]}") from None
        prefix = "specserve: serving on "
        assert line.startswith(prefix), (line, self.stderr[-3000:])
        self.url = line[len(prefix):].strip()
        self.stdout_lines = lines  # anything after the one line would show up here

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        return self.proc.returncode


class ThreadServer:
    """An ASGI app served by uvicorn on an ephemeral loopback port, in a thread with its own event loop."""

    def __init__(self, app, start_timeout_s: float = 30.0, http: type | str = "auto") -> None:
        import uvicorn

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("uvicorn thread did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "uvicorn thread did not stop"


# ----------------------------------------------------------------------------------------------- fake engine

@dataclass
class FakeDelta:
    """The fields of engine/core/outputs.py RequestDelta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: dict | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class FakeTokenizer:
    """Characters are tokens (ids 0..127); a chat template renders 'role: content' lines."""

    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant:"


@dataclass
class _FakeReq:
    rid: str
    prompt: list[int]
    max_tokens: int
    out: list[int] = field(default_factory=list)


class FakeEngine:
    """One token per running request per step: the letters a, b, c, ... (so text is easy to check).

    ``step_s`` makes a step take time (so tests can catch requests running); ``fail_at_step`` raises from a
    step, as a dying worker would.
    """

    vocab_size = 128  # the ids FakeTokenizer makes

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 64, step_s: float = 0.0,
                 fail_at_step: int | None = None, text: bool = True) -> None:
        self.max_num_seqs = max_num_seqs
        self.text = text  # False: a model without a tokenizer (every delta's text is empty)
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.fail_at_step = fail_at_step
        self.waiting: list[_FakeReq] = []
        self.running: list[_FakeReq] = []
        self.aborted: set[str] = set()
        self.steps = 0
        self.shut_down = False
        self.thread_ids: set[int] = set()  # threads that called into the engine (must be exactly one)

    def add_request(self, request_id: str, prompt, params, priority: int = 0) -> None:
        self.thread_ids.add(threading.get_ident())
        ids = FakeTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, the model's context is {self.max_model_len}")
        if any(not 0 <= t < 128 for t in ids):
            raise ValueError("prompt_token_ids: outside the vocabulary [0, 128)")
        self.waiting.append(_FakeReq(request_id, ids, params.max_tokens))

    def abort_request(self, request_id: str) -> bool:
        self.thread_ids.add(threading.get_ident())
        known = any(r.rid == request_id for r in self.waiting + self.running)
        if known:
            self.aborted.add(request_id)
        return known

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[FakeDelta]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("worker died")
        # Aborted requests leave (their KV is freed) at the next step.
        self.waiting = [r for r in self.waiting if r.rid not in self.aborted]
        self.running = [r for r in self.running if r.rid not in self.aborted]
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        if self.step_s:
            time.sleep(self.step_s)
        out = []
        for r in list(self.running):
            tok = ord("a") + len(r.out) % 26
            r.out.append(tok)
            done = len(r.out) >= r.max_tokens
            text = chr(tok) if self.text else ""
            out.append(FakeDelta(r.rid, [tok], text, done, "length" if done else None, len(r.prompt),
                                 len(r.out), {"rounds": len(r.out), "drafted_tokens": 2 * len(r.out),
                                              "accepted_tokens": len(r.out), "mean_acceptance_length": 2.0}
                                 if done else None))
            if done:
                self.running.remove(r)
        return out

    def shutdown(self) -> None:
        self.shut_down = True


def fake_stats(engine: FakeEngine):
    from engine.server.metrics import EngineStats

    return EngineStats(num_running=len(engine.running), num_waiting=len(engine.waiting),
                       kv_cache_usage=len(engine.running) / engine.max_num_seqs, num_drafts=engine.steps,
                       num_draft_tokens=2 * engine.steps, num_accepted_tokens=engine.steps,
                       accepted_per_position=(engine.steps,))


def fake_app(engine: FakeEngine, *, max_queue: int = 16, api_key: str | None = None, name: str = "fake",
             tokenizer: bool = True, limits=None):
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig

    ae = AsyncEngine(engine, max_queue=max_queue, metrics=ServerMetrics(name), stats_reader=fake_stats)
    return build_app(ae, ServerConfig(name), FakeTokenizer() if tokenizer else None, api_key=api_key,
                     limits=limits), ae


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def wait_until(pred, timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class HealthPoller:
    """GET /health every few milliseconds in a thread: the (HTTP status, body status) pairs, in order."""

    def __init__(self, url: str, interval_s: float = 0.01) -> None:
        self.seen: list[tuple[int, str]] = []
        self._stop = threading.Event()

        def poll() -> None:
            import httpx

            with httpx.Client(timeout=10) as c:
                while not self._stop.is_set():
                    try:
                        r = c.get(url + "/health")
                    except httpx.HTTPError:  # the server is stopping
                        return
                    s = (r.status_code, r.json().get("status"))
                    if not self.seen or self.seen[-1] != s:
                        self.seen.append(s)
                    self._stop.wait(interval_s)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(15)
        return self.seen
