"""The process that hosts one worker rank inside a Ray actor.

Ray starts it, places it and watches its health; per-round messages arrive either as Ray calls (``execute``)
or, on the hot path, as msgpack frames on a zmq PULL socket served by a background thread (``serve``).
Rank 0 of each role replies; the other ranks only run their share of the forward (and report errors).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from engine.execution import codec
from engine.execution.faults import injected_fault
from engine.execution.frames import FrameAuth
from engine.execution.loopback import collectives_on_loopback, is_loopback
from engine.execution.role import Role
from workers.law_channel import pack_laws
from workers.messages import TargetStep, TargetStepOutput, VerifyResult, WorkerReply
from workers.worker_config import WorkerConfig

OP_STEP = b"step"
OP_ECHO = b"echo"  # decode and answer without running the model: measures the transport alone
OP_STOP = b"stop"


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class WorkerProcess:
    """Wrapped by ``ray.remote`` in ray_executor.py (no Ray decorator here: no import-time side effects)."""

    def __init__(self, role: Role, config: WorkerConfig, rank: int, world_size: int, secret: bytes) -> None:
        self.role = role
        self.secret = secret  # signs and checks every zmq frame (engine/execution/frames.py)
        self._auths: dict[str, FrameAuth] = {}  # socket -> its signer/checker (dropped-frame counts)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._store_sock: socket.socket | None = None  # rank 0: where the group's store listens

    def address(self, loopback: bool = False) -> tuple[str, int]:
        """(host, port) of rank 0's torch.distributed store for its group, chosen per engine and listening from
        now on (``setup`` serves the store on it): 127.0.0.1 when every rank shares this machine."""
        if self._store_sock is not None:
            self._store_sock.close()
        self._store_sock = socket.create_server(("127.0.0.1" if loopback else node_ip(), 0))
        return self._store_sock.getsockname()[:2]

    def setup(self, master_addr: str, master_port: int, use_gpu: bool) -> str:
        """Join the role's process group and load this rank's shard; returns the device used."""
        import torch.distributed as dist

        from workers.distributed import TPGroup

        gpu = use_gpu and torch.cuda.is_available()
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU; without a real one (a cluster that declares
        # fake GPUs, or CPU-only nodes) the worker runs on the CPU with Gloo.
        device = "cuda:0" if gpu else "cpu"
        if gpu:
            torch.cuda.set_device(0)
        torch.set_num_threads(self.config.num_threads)
        tp = TPGroup.single()
        if self.world_size > 1:
            if is_loopback(master_addr):
                collectives_on_loopback()
            timeout = timedelta(minutes=10)
            master = self.rank == 0
            store = dist.TCPStore(master_addr, master_port, self.world_size, master, timeout,
                                  master_listen_fd=self._store_sock.fileno() if master else None)
            dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
            tp = TPGroup.from_process_group()
        cfg = dataclasses.replace(self.config, device=device)
        if self.role == Role.TARGET:
            from workers.target_worker import TargetWorker

            self.worker = TargetWorker(cfg, tp)
        elif cfg.eagle_target is not None:  # an EAGLE head: fed the target's hidden states (serve_features)
            from workers.eagle.draft_worker import EagleDraftWorker

            self.worker = EagleDraftWorker(cfg, tp)
            self.worker.features.timeout_s = cfg.step_timeout_s
        else:
            from workers.draft_worker import DraftWorker

            self.worker = DraftWorker(cfg, tp)
        return device

    def code(self) -> tuple[str, str]:
        """(node id, the folder this process imported the ``engine`` package from): see ``code_root``."""
        import ray

        return ray.get_runtime_context().get_node_id(), code_root()

    def describe(self) -> dict[str, Any]:
        """Where this rank landed (placement tests and diagnostics): the placement bundle it holds as Ray
        reports it, so a test can check bundle index == rank rather than trust our own bookkeeping."""
        import ray

        ctx = ray.get_runtime_context()
        return {"role": self.role, "rank": self.rank, "world_size": self.world_size, "node_id": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "actor_id": ctx.get_actor_id(), "placement_group_id": ctx.get_placement_group_id(),
                "bundle_index": _bundle_index(), "threads": torch.get_num_threads(),
                "frames_dropped": {name: a.dropped for name, a in self._auths.items()},
                "device": None if self.worker is None else str(self.worker.device)}

    def execute(self, payload: bytes) -> bytes:
        """One round through a Ray call."""
        return self._handle(OP_STEP, payload)

    def echo(self, payload: bytes) -> bytes:
        return self._handle(OP_ECHO, payload)

    def _handle(self, op: bytes, payload: bytes) -> bytes:
        try:
            msg = codec.decode(payload)
            if op == OP_ECHO:
                result: Any = _echo_result(msg)
            else:
                result = self.worker.step(msg)
            return codec.encode(WorkerReply(result=result if self.rank == 0 else None))
        except Exception:  # the controller re-raises it with the worker's traceback
            return codec.encode(WorkerReply(error=f"{self.role} rank {self.rank}: {traceback.format_exc()}"))

    def watch(self) -> None:
        """Never returns while this worker lives: the controller holds the call's reference, which Ray fails
        the moment the process dies (engine/execution/liveness.py). Takes one of the actor's concurrency slots."""
        self._stop.wait()

    def serve(self, controller_addr: str, loopback: bool, tag: bytes) -> str:
        """Start the zmq loop in a thread; returns the address the controller should push frames to.
        ``loopback``: the controller and every worker share this machine, so bind 127.0.0.1 only. ``tag``: how
        replies name their sender (role and generation: the controller ignores a replaced worker's replies)."""
        import zmq

        bind_host = "127.0.0.1" if loopback else node_ip()
        ctx = zmq.Context.instance()
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port(f"tcp://{bind_host}")
        push = ctx.socket(zmq.PUSH)
        push.connect(controller_addr)
        auth = FrameAuth(self.secret, f"{self.role} rank {self.rank}")
        self._auths["steps"] = auth

        def loop() -> None:
            while not self._stop.is_set():
                parts = auth.open(pull.recv_multipart(), 2)
                if parts is None:  # not from our controller: logged, never acted on
                    continue
                op, payload = parts
                if op == OP_STOP:
                    break
                reply = self._handle(op, payload)
                # Rank 0 answers every frame; other ranks speak only to report an error.
                if self.rank == 0 or codec.decode(reply).error is not None:
                    push.send_multipart(auth.seal([tag, str(self.rank).encode(), reply]))
            pull.close(linger=0)
            push.close(linger=0)

        self._thread = threading.Thread(target=loop, name=f"{self.role}-{self.rank}-zmq", daemon=True)
        self._thread.start()
        return f"tcp://{bind_host}:{port}"

    def serve_laws(self, loopback: bool) -> str:
        """Target rank 0: receive the draft's laws (workers/law_channel.py) on a PULL socket of its own, into the
        verifier's LawStore; returns the address draft rank 0 pushes to. The controller never sees them.
        Frames are signed like every other (engine/execution/frames.py): a forged law would be a wrong q."""
        store = self.worker.law_store
        return self._serve_pull("laws", f"the law receiver of target rank {self.rank}", "target-laws", loopback,
                                lambda frame: store.put(codec.decode(frame)), store.fail)

    def _serve_pull(self, kind: str, who: str, thread: str, loopback: bool, on_frame, on_error) -> str:
        """A signed PULL socket of its own, read on a thread until shutdown; each opened frame to ``on_frame``, the
        receiver's failure to ``on_error`` (so whoever waits on what it receives stops waiting). Its address."""
        import zmq

        bind_host = "127.0.0.1" if loopback else node_ip()
        pull = zmq.Context.instance().socket(zmq.PULL)
        port = pull.bind_to_random_port(f"tcp://{bind_host}")
        auth = self._auths[kind] = FrameAuth(self.secret, who)

        def loop() -> None:
            try:
                while not self._stop.is_set():
                    if pull.poll(timeout=1000):
                        parts = auth.open(pull.recv_multipart(), 1)
                        if parts is not None:
                            on_frame(parts[0])
            except Exception:
                on_error(f"{who} failed: {traceback.format_exc()}")
            finally:
                pull.close(linger=0)

        threading.Thread(target=loop, name=thread, daemon=True).start()
        return f"tcp://{bind_host}:{port}"

    def connect_laws(self, address: str, first_tree_id: int) -> None:
        """Draft rank 0: push the laws of every drafted tree to the verifier at ``address`` (again after the
        target was replaced). ``first_tree_id``: where a replacement draft starts numbering its trees, so a tree
        id is never one the verifier may still hold laws for from the draft it replaced."""
        import zmq

        self.worker._next_tree_id = max(self.worker._next_tree_id, first_tree_id)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        lock = threading.Lock()  # Ray calls and the zmq loop may both run steps: one sender at a time
        auth = FrameAuth(self.secret, f"the law sender of draft rank {self.rank}")
        die_at = injected_fault("draft_dies_before_laws")  # tests only (engine/execution/faults.py)
        sent = [0]

        def send(laws) -> None:
            frame = codec.encode([pack_laws(d) for d in laws])  # compact: supports, exact float32
            with lock:
                sent[0] += 1
                if sent[0] == die_at:  # the frame is lost; the reply goes out, then this process dies
                    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
                    return
                push.send_multipart(auth.seal([frame]), copy=False)

        self.worker.law_sink = send

    def serve_features(self, loopback: bool) -> str:
        """Draft rank 0 of an EAGLE head: receive the target's hidden states (workers/eagle/features.py) on a PULL
        socket of its own, into the head's FeatureStore; returns the address target rank 0 pushes to."""
        from workers.eagle.features import SeqFeatures

        store = self.worker.features

        def put(frame) -> None:
            rows, finished = codec.decode(frame)
            store.put([SeqFeatures(s, start, t) for s, start, t in rows], finished)

        return self._serve_pull("features", f"the feature receiver of draft rank {self.rank}", "draft-features",
                                loopback, put, store.fail)

    def connect_features(self, address: str, layers: list[int]) -> None:
        """Target rank 0: capture ``layers`` and push every step's committed rows to the head at ``address``
        (again after either side was replaced). The controller never sees them."""
        import zmq

        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        auth = FrameAuth(self.secret, f"the feature sender of target rank {self.rank}")

        def send(feats, finished) -> None:
            frame = codec.encode([[[f.seq_id, f.start, f.rows] for f in feats], list(finished)])
            push.send_multipart(auth.seal([frame]), copy=False)

        self.worker.feed_eagle(tuple(layers), send)

    def fail_laws(self, error: str, below: int) -> None:
        """Target rank 0: the draft that numbered trees below ``below`` died; a verification waiting for their laws
        stops now (workers/law_channel.py). Served on its own thread while a step may be running."""
        self.worker.law_store.fail(error, below)

    def shutdown(self) -> None:
        self._stop.set()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def code_root() -> str:
    """The folder holding the ``engine`` package this process imported. Ray puts the driver's working directory
    first on its workers' sys.path, so a worker may import another copy of the code than the controller (e.g.
    ``specserve`` from the editable install, run inside a checkout of another version)."""
    # This file is engine/execution/worker_actor.py: three levels up is the folder that holds ``engine``.
    return str(Path(os.path.abspath(__file__)).parents[2])


def _bundle_index() -> int | None:
    """The placement-group bundle this actor runs in (None if Ray does not say).

    Ray names the resources a bundle grants ``<resource>_group_<index>_<group id>``; the public runtime context
    hides them, so this reads the core worker's view (a private API: a Ray upgrade may need this revisited).
    """
    try:
        import ray

        names = ray._private.worker.global_worker.core_worker.resource_ids()
    except Exception:
        return None
    found = {int(m.group(1)) for m in map(_BUNDLE_RESOURCE.match, names) if m}
    return found.pop() if len(found) == 1 else None


_BUNDLE_RESOURCE = re.compile(r"^bundle_group_(\d+)_[0-9a-f]+$")


def _echo_result(msg: Any) -> Any:
    """A reply shaped like a real one, so the benchmark pays the same encoding costs."""
    if isinstance(msg, TargetStep):
        return TargetStepOutput(first_tokens={}, results=[
            VerifyResult(list(range(len(s.tree_tokens))), s.tree_tokens + [0], len(s.tree_tokens), True)
            for s in msg.seqs])
    return None
