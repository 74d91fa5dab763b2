"""The draft in a local process of its own, pinned to its own core(s); the target stays in this process, its
forwards pinned to the target's core(s).

Why: in ``LocalExecutor`` the draft is a thread beside the target, and the two compete for the same cores (and the
interpreter lock): issue 18 measured verification 1.6-2.3x slower while a pre-draft runs beside it. Here each role
has its cores (``os.sched_setaffinity``) and as many torch threads as cores, so they do not oversubscribe.

The child is a plain ``python -m engine.draft_process`` hosting the same ``WorkerProcess`` the Ray executor puts
in an actor (engine/worker_actor.py), without Ray: the hot path is the same signed msgpack frames over zmq on
loopback (controller -> draft steps, draft -> controller replies, draft -> verifier laws). Every wait on the child
watches its liveness: a reply wait polls ``Popen.poll()`` every ``POLL_S``, and a watcher thread fails the
verifier's law store the moment the child exits, so a verification waiting for laws never waits out its timeout.

Start-up: the controller writes one JSON line to the child's stdin (the worker config, the frame secret, the
addresses, the cores), the child answers one JSON line on stdout with the address it serves steps on. The secret
never appears on a command line. A child whose parent dies exits within a second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from engine import codec
from engine.faults import WorkerDiedError, WorkerStuckError
from engine.frames import FrameAuth, new_secret
from engine.liveness import POLL_S
from engine.worker_actor import OP_STEP, OP_STOP, WorkerProcess
from workers.messages import DraftStep, DraftStepOutput, TargetStep, TargetStepOutput, WorkerReply
from workers.worker_config import WorkerConfig

STEP_TIMEOUT_S = float(os.environ.get("SPECSERVE_STEP_TIMEOUT_S", "600"))
START_TIMEOUT_S = 300.0  # loading the draft under load
_TAG = b"draft/1"


def check_cores(cores: list[int] | None, what: str) -> set[int] | None:
    """The cores as a set, refused with the field named if this process may not run on them."""
    if cores is None:
        return None
    allowed = os.sched_getaffinity(0)
    bad = sorted(set(cores) - allowed)
    if bad:
        raise ValueError(f"speculative_config.{what} names core(s) {bad} this process may not use; "
                         f"available: {sorted(allowed)}")
    return set(cores)


class DraftProcessExecutor:
    """Target in this process (pinned to ``target_cores``), draft in a child process (pinned to ``draft_cores``)."""

    def __init__(self, target: WorkerConfig, draft: WorkerConfig, draft_cores: list[int] | None = None,
                 target_cores: list[int] | None = None) -> None:
        import zmq

        from workers.target_worker import TargetWorker

        dcores = check_cores(draft_cores, "draft_cores")
        tcores = check_cores(target_cores, "target_cores")
        self._proc: subprocess.Popen | None = None
        self._push = self._reply = None
        self._host: WorkerProcess | None = None
        self._in_flight = False
        self._target_msg: TargetStep | None = None
        self._tcores = tcores
        try:
            self.target = TargetWorker(target)
            secret = new_secret()
            self._auth = FrameAuth(secret, "controller")
            # The verifier's law receiver: the host a Ray actor would be, minus Ray (loopback, signed frames).
            self._host = WorkerProcess("target", target, 0, 1, secret)
            self._host.worker = self.target
            laws = self._host.serve_laws(True)
            ctx = zmq.Context.instance()
            self._reply = ctx.socket(zmq.PULL)
            reply = f"tcp://127.0.0.1:{self._reply.bind_to_random_port('tcp://127.0.0.1')}"
            # The child imports this very copy of the package (not whichever one its path would find first).
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen([sys.executable, "-m", "engine.draft_process"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
            self._proc.stdin.write(json.dumps({
                "config": dataclasses.asdict(draft), "secret": secret.hex(), "controller": reply, "laws": laws,
                "cores": sorted(dcores) if dcores is not None else None}) + "\n")
            self._proc.stdin.close()
            endpoint = self._read_endpoint()
            self._push = ctx.socket(zmq.PUSH)
            self._push.connect(endpoint)
            self.endpoints = {"draft": [endpoint], "controller": [reply], "laws": [laws]}
            # A draft that dies between its reply and its laws must not leave verification waiting 600 s.
            threading.Thread(target=self._watch, name="draft-process-watch", daemon=True).start()
        except BaseException:
            self.shutdown()
            raise

    def _read_endpoint(self) -> str:
        """The child's one stdout line, read while watching that it lives."""
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self._proc.stdout.readline()), daemon=True)
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(POLL_S)
            if self._proc.poll() is not None and t.is_alive():
                break
            if time.monotonic() > deadline:
                raise WorkerStuckError("draft", START_TIMEOUT_S)
        line = box[0] if box else ""
        if not line.strip():
            raise WorkerDiedError("draft", 0, f"the draft process exited while starting (code {self._proc.wait()})")
        return json.loads(line)["endpoint"]

    def _watch(self) -> None:
        proc = self._proc
        code = proc.wait()
        if self._host is not None and not self._host._stop.is_set():
            self.target.law_store.fail(f"the draft process exited (code {code})")

    # --------------------------------------------------------------------------------------------- hot path
    def submit_draft(self, msg: DraftStep) -> None:
        if self._in_flight:
            raise RuntimeError("a draft call is already in flight")
        self._push.send_multipart(self._auth.seal([OP_STEP, codec.encode(msg)]), copy=False)
        self._in_flight = True

    def wait_draft(self) -> DraftStepOutput:
        import zmq

        if not self._in_flight:
            raise RuntimeError("no draft call in flight")
        self._in_flight = False
        start = time.monotonic()
        while True:
            if self._reply.poll(timeout=int(POLL_S * 1000), flags=zmq.POLLIN):
                parts = self._auth.open(self._reply.recv_multipart(), 3)
                if parts is not None and parts[0] == _TAG:  # else: not signed by us (logged, dropped)
                    reply: WorkerReply = codec.decode(parts[2])
                    if reply.error is not None:
                        raise RuntimeError(f"worker failed:\n{reply.error}")
                    return reply.result
            waited = time.monotonic() - start
            code = self._proc.poll()
            if code is not None:
                raise WorkerDiedError("draft", 0, f"the draft process exited (code {code})", waited)
            if waited > STEP_TIMEOUT_S:
                raise WorkerStuckError("draft", STEP_TIMEOUT_S)

    def submit_target(self, msg: TargetStep) -> None:
        # Runs in wait_target, on the caller's thread (its cores), while the draft process works on its own.
        assert self._target_msg is None, "a target call is already in flight"
        self._target_msg = msg

    def wait_target(self) -> TargetStepOutput:
        assert self._target_msg is not None, "no target call in flight"
        msg, self._target_msg = self._target_msg, None
        if self._tcores is None:
            return self.target.step(msg)
        # Pinned for the forward only, then the caller's placement again: this process may host other engines
        # (bench compare interleaves modes), and pinning the calling thread for good would hold them to it too.
        # With more than one target core, torch's pool threads keep the mask they were started with.
        saved = (os.sched_getaffinity(0), torch.get_num_threads())
        os.sched_setaffinity(0, self._tcores)
        if saved[1] != len(self._tcores):
            torch.set_num_threads(len(self._tcores))
        try:
            return self.target.step(msg)
        finally:
            os.sched_setaffinity(0, saved[0])
            if saved[1] != len(self._tcores):
                torch.set_num_threads(saved[1])

    def describe(self) -> dict[str, Any]:
        return {"draft_pid": self._proc.pid if self._proc else None,
                "target_cores": sorted(self._tcores) if self._tcores is not None else None}

    def shutdown(self) -> None:
        if self._host is not None:
            self._host._stop.set()  # the law receiver's loop ends within a second
        if self._push is not None:
            try:
                self._push.send_multipart(self._auth.seal([OP_STOP, b""]), flags=1)  # zmq.NOBLOCK
            except Exception:
                pass
            self._push.close(linger=0)
            self._push = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._reply is not None:
            self._reply.close(linger=0)
            self._reply = None
        self.target = None  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------------- the child
def _main() -> None:
    start = json.loads(sys.stdin.readline())
    parent = os.getppid()
    cores = start["cores"]
    if cores is not None:
        os.sched_setaffinity(0, set(cores))
    # WorkerProcess.setup reads the thread count from here: one torch thread per core of its own.
    os.environ["SPECSERVE_WORKER_THREADS"] = str(len(cores) if cores else
                                                 os.environ.get("SPECSERVE_WORKER_THREADS", "1"))
    config = WorkerConfig(**start["config"])
    host = WorkerProcess("draft", config, 0, 1, bytes.fromhex(start["secret"]))
    host.setup("127.0.0.1", 0, use_gpu=config.device.startswith("cuda"))  # the same GPU as the target (cuda:0)
    host.connect_laws(start["laws"], 0)
    endpoint = host.serve(start["controller"], True, _TAG)
    print(json.dumps({"endpoint": endpoint}), flush=True)
    os.dup2(2, 1)  # nobody reads the pipe after this line: anything printed later must not fill it and block
    while host._thread.is_alive():  # ends on OP_STOP
        host._thread.join(1.0)
        if os.getppid() != parent:  # the controller is gone: nobody will ever send OP_STOP
            os._exit(0)


if __name__ == "__main__":
    _main()
