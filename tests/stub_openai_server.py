"""A stub OpenAI-compatible streaming server with a known schedule, for the load-test tests (in a subprocess).

Every request: the response headers after ``header_delay_s`` (a server that queues before answering), the first
text chunk ``first_token_s`` after the headers, then a chunk every ``interval_s``; each chunk carries
``tokens_per_chunk`` tokens until ``max_tokens`` are out; then a usage chunk and ``[DONE]``. Times are
absolute deadlines from the request's arrival, so scheduling jitter does not accumulate. A prompt containing
``FAIL_HTTP`` gets a 500 (after the header delay); one containing ``FAIL_STREAM`` stops after two chunks
without ``[DONE]``. The stub records the bodies it received and its peak number of requests in flight, and
exposes specserve-style speculative-decoding counters at /metrics that grow by a fixed amount per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

# Per finished request, the counters at /metrics grow by: 3 drafts of 4 tokens, 6 accepted (3, 2, 1 by position)
DRAFTS_PER_REQ, DRAFT_TOKENS_PER_REQ, ACCEPTED_PER_POS = 3, 12, (3, 2, 1, 0)


@dataclass
class Schedule:
    header_delay_s: float = 0.0
    first_token_s: float = 0.1
    interval_s: float = 0.02
    tokens_per_chunk: int = 1
    capacity: int = 0  # > 0: at most this many requests generate at once, the rest wait (a saturating server)


@dataclass
class StubState:
    in_flight: int = 0
    waiting: int = 0
    peak: int = 0
    bodies: list[dict] = field(default_factory=list)
    finished: int = 0
    # per request, on the host's monotonic clock (time.perf_counter, shared by processes): when the request
    # was read, when each text chunk and the final [DONE] were handed to the server
    timeline: list[dict] = field(default_factory=list)


def make_app(schedule: Schedule, state: StubState) -> FastAPI:
    app = FastAPI()
    slots = asyncio.Semaphore(schedule.capacity) if schedule.capacity > 0 else None

    def leave() -> None:
        state.in_flight -= 1

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    @app.get("/stub/state")
    async def stub_state() -> JSONResponse:
        return JSONResponse(asdict(state))

    @app.post("/stub/reset_peak")
    async def reset_peak() -> JSONResponse:
        state.peak = state.in_flight
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        n = state.finished
        lines = ["# TYPE specserve:spec_decode_num_drafts_total counter",
                 f"specserve:spec_decode_num_drafts_total{{model_name=\"stub\"}} {n * DRAFTS_PER_REQ}",
                 "# TYPE specserve:spec_decode_num_draft_tokens_total counter",
                 f"specserve:spec_decode_num_draft_tokens_total{{model_name=\"stub\"}} {n * DRAFT_TOKENS_PER_REQ}",
                 "# TYPE specserve:spec_decode_num_accepted_tokens_total counter",
                 f"specserve:spec_decode_num_accepted_tokens_total{{model_name=\"stub\"}} {n * sum(ACCEPTED_PER_POS)}",
                 "# TYPE specserve:spec_decode_num_accepted_tokens_per_pos_total counter"]
        lines += [f"specserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"stub\",position=\"{i}\"}} "
                  f"{n * a}" for i, a in enumerate(ACCEPTED_PER_POS)]
        lines += ["# TYPE specserve:num_requests_running gauge", f"specserve:num_requests_running {state.in_flight}",
                  "# TYPE specserve:num_requests_waiting gauge", f"specserve:num_requests_waiting {state.waiting}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def completion(request: Request, chat: bool):
        arrival = time.perf_counter()
        body = await request.json()
        state.bodies.append(body)
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        text_prompt = prompt if isinstance(prompt, str) else ""
        await asyncio.sleep(max(0.0, arrival + schedule.header_delay_s - time.perf_counter()))
        if "FAIL_HTTP" in text_prompt:
            leave()
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error"}}, status_code=500)
        n_out = int(body.get("max_tokens") or 16)
        kind = "chat.completion.chunk" if chat else "text_completion"
        if slots is not None:
            state.waiting += 1
            try:
                await slots.acquire()
            finally:
                state.waiting -= 1
        headers_at = time.perf_counter()
        times: dict = {"prompt": prompt, "received": arrival, "chunks": [], "done": None}
        state.timeline.append(times)

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            return "data: " + json.dumps({"id": "x", "object": kind, "choices": [choice]}) + "\n\n"

        async def events():
            left = True
            try:
                sent, k = 0, 0
                while sent < n_out:
                    due = headers_at + schedule.first_token_s + k * schedule.interval_s
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    take = min(schedule.tokens_per_chunk, n_out - sent)
                    times["chunks"].append(time.perf_counter())
                    yield chunk(" tok" * take)
                    sent, k = sent + take, k + 1
                    if k == 2 and "FAIL_STREAM" in text_prompt:
                        return
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
                yield "data: " + json.dumps({"id": "x", "object": kind, "choices": [], "usage": usage}) + "\n\n"
                state.finished += 1
                # Leave before the last event: a client that sends its next request as soon as it reads [DONE]
                # must not be counted twice.
                leave()
                left = False
                times["done"] = time.perf_counter()
                yield "data: [DONE]\n\n"
            finally:
                if left:
                    leave()
                if slots is not None:
                    slots.release()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    return app


class StubServer:
    """Runs the stub in a subprocess on an ephemeral loopback port (a context manager). A process of its own,
    not a thread: a server thread would share the client's GIL, and the handoffs (5 ms switch interval) would
    show up as latency the schedule does not have."""

    def __init__(self, schedule: Schedule | None = None):
        self.schedule = schedule or Schedule()
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> StubServer:
        cmd = [sys.executable, "-m", "tests.stub_openai_server", "--schedule", json.dumps(asdict(self.schedule))]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        line = self.proc.stdout.readline()  # the child prints its URL once it listens, or exits
        if not line.startswith("specserve: serving on "):
            self.__exit__()
            raise RuntimeError(f"the stub server did not start: {line!r}")
        self.url = line.split()[-1]
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def state(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stub/state", timeout=10).json()

    def reset_peak(self) -> None:
        import httpx

        httpx.post(self.url + "/stub/reset_peak", timeout=10)


def _serve(schedule: Schedule, host: str, port: int) -> None:
    import socket

    sock = socket.socket()
    sock.bind((host, port))
    cfg = uvicorn.Config(make_app(schedule, StubState()), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(cfg)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        print(f"specserve: serving on http://{host}:{sock.getsockname()[1]}", flush=True)  # as specserve serve
        await task

    asyncio.run(run())


if __name__ == "__main__":
    # specserve serve's flags that a sweep passes (--speculative-config, --port, --host), so that the sweep can
    # start the stub in place of the real server; others are ignored
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="{}", help="Schedule fields as JSON")
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a, _ = ap.parse_known_args()
    _serve(Schedule(**json.loads(a.schedule)), a.host, a.port)
