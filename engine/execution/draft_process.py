"""The draft in a local process of its own, pinned to its own core(s); the target stays in this process, its
forwards pinned to the target's core(s).

Why: in ``LocalExecutor`` the draft is a thread beside the target, and the two compete for the same cores (and the
interpreter lock): issue 18 measured verification 1.6-2.3x slower while a pre-draft runs beside it. Here each role
has its cores (``os.sched_setaffinity``) and as many torch threads as cores, so they do not oversubscribe. A
target call with no draft call in flight (a sequential step, engine/drafting/pipeline_switch.py; a prefill) may run on
both roles' cores (the draft is idle then), with the same number of torch threads as always (seeded tokens must not
depend on which phase a step ran in).

The child is a plain ``python -m engine.execution.draft_process``, hosting the same ``WorkerProcess``
the Ray executor puts in an actor (worker_actor.py), without Ray: the hot path is the same signed msgpack
frames over zmq on loopback (controller -> draft steps, draft -> controller replies, draft -> verifier laws).
Every wait on the child watches its liveness: a reply wait polls ``Popen.poll()`` every ``POLL_S``, and a watcher
thread fails the verifier's waits for that child's laws the moment it exits, so a verification never waits out its
timeout. A dead child is replaced like a Ray draft worker (recovery.py): the engine decodes without speculation
until the new one is up.

Start-up: the controller writes one JSON line to the child's stdin (the worker config, the frame secret, the
addresses, the cores), the child answers one JSON line on stdout with the address it serves steps on. The secret
never appears on a command line. A child whose parent dies exits within a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from engine.execution import codec
from engine.execution.faults import WorkerDiedError, WorkerStuckError
from engine.execution.frames import FrameAuth, new_secret
from engine.execution.liveness import POLL_S
from engine.execution.role import Role
from engine.execution.worker_actor import OP_STEP, OP_STOP, WorkerProcess
from workers.law_channel import LawStore, first_tree_id
from workers.messages import DraftStep, DraftStepOutput, TargetStep, TargetStepOutput, WorkerReply
from workers.worker_config import WorkerConfig

START_TIMEOUT_S = 300.0  # loading the draft under load


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
    """Target in this process (pinned to ``target_cores``), draft in a child process (pinned to ``draft_cores``).

    Recovery (recovery.py), for the draft only: a dead child is replaced by a new one (``begin_restart``,
    which does not wait for it to load; ``finish_restart``) while the engine decodes without speculation. Child
    ``g`` (its generation, from 1) numbers its trees from ``first_tree_id(g)`` and tags its replies ``draft/g``, so
    its death fails only the verifier's waits for its own trees and a reply it left behind answers nothing later.
    The target dies with this process: there is nothing to restart apart from the engine.
    """

    def __init__(self, target: WorkerConfig, draft: WorkerConfig, draft_cores: list[int] | None = None,
                 target_cores: list[int] | None = None) -> None:
        import zmq

        from workers.target_worker import TargetWorker

        dcores = check_cores(draft_cores, "draft_cores")
        self._tcores = check_cores(target_cores, "target_cores")
        self._draft, self._dcores = draft, sorted(dcores) if dcores is not None else None
        self.step_timeout_s = target.step_timeout_s  # make_executor sets both roles' from ParallelConfig
        self._proc: subprocess.Popen | None = None
        self._gen = 0  # how many draft processes were started
        self._push = self._reply = None
        self._host: WorkerProcess | None = None
        self._in_flight = False
        self._target_msg: TargetStep | None = None
        try:
            self.target = TargetWorker(target)
            self._secret = new_secret()
            self._auth = FrameAuth(self._secret, "controller")
            # The verifier's law receiver: the host a Ray actor would be, minus Ray (loopback, signed frames).
            # It outlives the draft processes: each new one pushes its laws to the same address.
            self._host = WorkerProcess(Role.TARGET, target, 0, 1, self._secret)
            self._host.worker = self.target
            self._laws = self._host.serve_laws(True)
            self._reply = zmq.Context.instance().socket(zmq.PULL)
            self._reply_addr = f"tcp://127.0.0.1:{self._reply.bind_to_random_port('tcp://127.0.0.1')}"
            self._spawn()
            self.finish_restart(Role.DRAFT, block=True)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self) -> None:
        """Start the next generation's draft process; ``finish_restart`` connects to it once it is up."""
        self._gen += 1
        # The child imports this very copy of the package (not whichever one its path would find first).
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "engine.execution.draft_process"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        self._line: list[str] = []  # its one stdout line (where it serves steps), once read
        self._reader = threading.Thread(target=_read_line, args=(proc, self._line), name="draft-process-start",
                                        daemon=True)
        self._reader.start()
        self._proc, self._started = proc, time.monotonic()
        self.endpoints = {Role.DRAFT: [], "controller": [self._reply_addr], "laws": [self._laws]}  # diagnostics
        with contextlib.suppress(BrokenPipeError):  # it died at once: finish_restart says so
            proc.stdin.write(json.dumps({
                "config": dataclasses.asdict(self._draft), "secret": self._secret.hex(),
                "controller": self._reply_addr, "laws": self._laws, "cores": self._dcores,
                "tag": self._tag().decode(), "first_tree_id": first_tree_id(self._gen)}) + "\n")
            proc.stdin.close()
        # A draft that dies between its reply and its laws must not leave verification waiting 600 s.
        threading.Thread(target=self._watch, args=(proc, self._gen, self.target.law_store),
                         name="draft-process-watch", daemon=True).start()

    def _tag(self) -> bytes:
        return f"draft/{self._gen}".encode()

    def _watch(self, proc: subprocess.Popen, gen: int, store: LawStore) -> None:
        code = proc.wait()
        if self._host is not None and not self._host._stop.is_set():
            # Only the trees this generation numbered: the next generation's laws are still taken.
            store.fail(f"the draft process exited (code {code})", first_tree_id(gen + 1))

    def _died(self, what: str, waited_s: float | None = None) -> WorkerDiedError:
        return WorkerDiedError(Role.DRAFT, 0, f"the draft process exited{what} (code {self._proc.poll()})", waited_s)

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
                # Else not signed by us (logged, dropped), or a reply a replaced process sent before it died.
                if parts is not None and parts[0] == self._tag():
                    reply: WorkerReply = codec.decode(parts[2])
                    if reply.error is not None:
                        raise RuntimeError(f"worker failed:\n{reply.error}")
                    return reply.result
            waited = time.monotonic() - start
            if self._proc.poll() is not None:
                raise self._died("", waited)
            if waited > self.step_timeout_s:
                raise WorkerStuckError(Role.DRAFT, self.step_timeout_s)

    def submit_target(self, msg: TargetStep) -> None:
        # Runs in wait_target, on the caller's thread (its cores), while the draft process works on its own.
        assert self._target_msg is None, "a target call is already in flight"
        self._target_msg = msg

    def wait_target(self) -> TargetStepOutput:
        assert self._target_msg is not None, "no target call in flight"
        msg, self._target_msg = self._target_msg, None
        out = self._target_step(msg)
        if out.laws_error is not None:  # the step verified nothing: abandoned, like any step a worker died in
            if self._proc.poll() is not None:  # the watcher reaped it before failing the laws: poll() sees it
                raise self._died(" before its laws reached the verifier")
            raise RuntimeError(f"the target could not verify, although the draft process is alive: "
                               f"{out.laws_error}")
        return out

    def _target_step(self, msg: TargetStep) -> TargetStepOutput:
        if self._tcores is None:
            return self.target.step(msg)
        # Pinned for the forward only, then the caller's placement again: this process may host other engines
        # (bench compare interleaves modes), and pinning the calling thread for good would hold them to it too.
        # With more than one target core, torch's pool threads keep the mask they were started with.
        # No draft call in flight (a sequential step, pipeline_switch.py): the draft process waits on its
        # socket, so the target may use its cores too — each phase then has every core, like a sequential engine.
        # The thread count stays len(target_cores) whatever the phase: kernels may sum in another order with
        # another thread count (float32 SDPA does past ~200 keys), and which phase a step runs in depends on the
        # load, so a seeded request's tokens would too (tests/test_seed_under_load.py).
        cores = self._tcores if self._in_flight or self._dcores is None else self._tcores | set(self._dcores)
        saved = (os.sched_getaffinity(0), torch.get_num_threads())
        threads = len(self._tcores)
        os.sched_setaffinity(0, cores)
        if saved[1] != threads:
            torch.set_num_threads(threads)
        try:
            return self.target.step(msg)
        finally:
            os.sched_setaffinity(0, saved[0])
            if saved[1] != threads:
                torch.set_num_threads(saved[1])

    def describe(self) -> dict[str, Any]:
        return {"draft_pid": self._proc.pid if self._proc else None, "draft_generation": self._gen,
                "target_cores": sorted(self._tcores) if self._tcores is not None else None}

    # --------------------------------------------------------------------------------------------- recovery
    def in_flight(self) -> list[Role]:
        return ([Role.DRAFT] if self._in_flight else []) + ([Role.TARGET] if self._target_msg is not None else [])

    def discard_in_flight(self, role: Role) -> None:
        """Forget a call that will never be answered (its worker died): nothing is waited for."""
        if role == Role.DRAFT:
            self._in_flight = False
        else:
            self._target_msg = None

    def begin_restart(self, role: Role) -> None:
        """Replace the draft process: kill the old one if it is still there, start a new one, do not wait."""
        if role != Role.DRAFT:
            raise RuntimeError(f"the {role} runs in the engine's own process (draft_process): it cannot be "
                               "restarted apart from the engine")
        self.discard_in_flight(Role.DRAFT)
        self._stop_child(graceful=False)
        self._spawn()

    def finish_restart(self, role: Role, block: bool) -> bool:
        """True once the new draft process has said where it serves and is connected (``block``: wait for it).
        Raises WorkerDiedError if it exits while starting, WorkerStuckError if it is not up in START_TIMEOUT_S."""
        import zmq

        if self._push is not None or role != Role.DRAFT:  # the target is never restarting (``begin_restart``)
            return True
        while self._reader.is_alive():  # ends with the line, or at EOF when the child exits
            if self._proc.poll() is not None:
                raise self._died(" while starting")
            if not block:
                return False
            if time.monotonic() - self._started > START_TIMEOUT_S:
                raise WorkerStuckError(Role.DRAFT, START_TIMEOUT_S)
            self._reader.join(POLL_S)
        line = self._line[0] if self._line else ""
        if not line.strip():  # EOF before the line: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            raise self._died(" while starting")
        endpoint = json.loads(line)["endpoint"]
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.connect(endpoint)
        self.endpoints[Role.DRAFT] = [endpoint]
        return True

    # --------------------------------------------------------------------------------------------- shutdown
    def _stop_child(self, graceful: bool) -> None:
        """Stop the draft process: OP_STOP and a few seconds to exit if ``graceful`` and it is up, else killed."""
        if self._push is not None:
            if graceful:
                try:
                    self._push.send_multipart(self._auth.seal([OP_STOP, b""]), flags=1)  # zmq.NOBLOCK
                except Exception:
                    pass
            self._push.close(linger=0)
            self._push = None
        else:
            graceful = False  # still starting (or never connected): nobody would read OP_STOP
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5 if graceful else 0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reader.join(1.0)  # at EOF now that the child is gone: close the pipe after its last read
            self._proc.stdout.close()

    def shutdown(self) -> None:
        if self._host is not None:
            self._host._stop.set()  # the law receiver's loop ends within a second
        self._stop_child(graceful=True)
        self._proc = None
        if self._reply is not None:
            self._reply.close(linger=0)
            self._reply = None
        self.target = None  # type: ignore[assignment]


def _read_line(proc: subprocess.Popen, box: list[str]) -> None:
    """The child's one stdout line (or "" at EOF: it exited); read on a thread so the caller can watch it live."""
    try:
        box.append(proc.stdout.readline())
    except (OSError, ValueError):  # the pipe was closed under us: the child was stopped while starting
        box.append("")


# ------------------------------------------------------------------------------------------------- the child
def _main() -> None:
    start = json.loads(sys.stdin.readline())
    parent = os.getppid()
    cores = start["cores"]
    if cores is not None:
        os.sched_setaffinity(0, set(cores))
    config = WorkerConfig(**start["config"])
    if cores:  # one torch thread per core of its own
        config = dataclasses.replace(config, num_threads=len(cores))
    host = WorkerProcess(Role.DRAFT, config, 0, 1, bytes.fromhex(start["secret"]))
    host.setup("127.0.0.1", 0, use_gpu=config.device.startswith("cuda"))  # the same GPU as the target (cuda:0)
    host.connect_laws(start["laws"], start["first_tree_id"])  # its generation's tree ids: see the executor
    endpoint = host.serve(start["controller"], True, start["tag"].encode())
    print(json.dumps({"endpoint": endpoint}), flush=True)
    os.dup2(2, 1)  # nobody reads the pipe after this line: anything printed later must not fill it and block
    while host._thread.is_alive():  # ends on OP_STOP
        host._thread.join(1.0)
        if os.getppid() != parent:  # the controller is gone: nobody will ever send OP_STOP
            os._exit(0)


if __name__ == "__main__":
    _main()
