"""Workers in Ray actors: the draft on its own bundle(s), the target's tensor-parallel ranks packed on one node.

Ray does placement, lifecycle and health; the per-round messages go over zmq as msgpack frames (or, with
``transport="ray"``, as plain actor calls — kept for comparison; deploy/README.md has the measured difference). The
draft's laws take a third path, draft rank 0 straight to target rank 0 (``_connect_laws``): the controller
sends and receives ints only.
"""

from __future__ import annotations

import os
import time
from typing import Any

from engine.core.config import ParallelConfig
from engine.drafting.eagle import aux_layers_of
from engine.execution import codec
from engine.execution.code_check import check_worker_code
from engine.execution.faults import WorkerDiedError, WorkerStuckError
from engine.execution.frames import FrameAuth, new_secret
from engine.execution.liveness import POLL_S, LivenessWatch, died_because
from engine.execution.placement import PlacementPlan, plan_placement
from engine.execution.ray_cluster import PlacementGroups, init_ray
from engine.execution.role import Role
from engine.execution.worker_actor import OP_ECHO, OP_STEP, OP_STOP, WorkerProcess, node_ip
from workers.law_channel import first_tree_id
from workers.messages import DraftStep, DraftStepOutput, TargetStep, TargetStepOutput, WorkerReply
from workers.worker_config import WorkerConfig

ERROR_GRACE_S = 2.0  # after a worker's error, how long to look for a dead rank behind it


class RayExecutor:
    def __init__(self, parallel: ParallelConfig, target: WorkerConfig, draft: WorkerConfig | None) -> None:
        import ray

        self.parallel = parallel
        self.step_timeout_s = parallel.step_timeout_s
        target = parallel.for_worker(target)  # also when built directly, not through make_executor
        draft = parallel.for_worker(draft) if draft is not None else None
        self._started_ray = False
        self._groups = PlacementGroups(parallel.placement_timeout_s)
        self._configs: dict[str, WorkerConfig] = {}
        self._actors: dict[Role, list[Any]] = {Role.TARGET: [], Role.DRAFT: []}
        self._generation: dict[Role, int] = {}  # role -> how many times its group was started
        self._starting: dict[Role, list[Any]] = {}  # role -> setup references of a group being restarted
        self._liveness = LivenessWatch()
        self._secret = new_secret()  # signs every zmq frame; reaches the actors with their constructor
        self._auth = FrameAuth(self._secret, "controller")
        self._zmq: dict[Role, list[Any]] = {}
        self._reply = None
        self._reply_addrs: dict[bool, str] = {}  # loopback? -> address of the reply socket
        self.endpoints: dict[str, list[str]] = {}  # role -> the workers' zmq addresses (diagnostics, tests)
        self._in_flight: dict[Role, Any] = {}  # role -> Ray refs (ray transport) or None (zmq)
        self._replies: dict[Role, Any] = {}  # zmq replies that arrived while waiting for the other role
        # The draft's death, noticed while waiting for the target: the verifier was told its pending laws will
        # not come (``_watch_law_sender``), and the target's reply says whether it needed them.
        self._law_sender_died: WorkerDiedError | None = None
        try:
            if not ray.is_initialized():
                init_ray(parallel, draft is not None)
                self._started_ray = True
            plan = plan_placement(parallel.tensor_parallel_size, parallel.draft_tensor_parallel_size,
                                  draft is not None, ray.cluster_resources().get("GPU", 0.0))
            self.plan = plan
            roles = {Role.TARGET: (target, plan.target_bundles, "STRICT_PACK")}
            if draft is not None:
                # The draft's own ranks (if any) need a fast link among themselves too; the draft as a whole
                # may still sit on another node than the target.
                roles[Role.DRAFT] = (draft, plan.draft_bundles, "STRICT_PACK")
            # Every bundle is reserved before any worker starts, so a plan the cluster cannot hold fails
            # within placement_timeout_s without loading a model first; then both roles start side by side.
            groups = self._groups.reserve(plan, {role: (bundles, strategy)
                                                 for role, (_, bundles, strategy) in roles.items()})
            for (role, (config, _, _)), pg in zip(roles.items(), groups, strict=True):
                self._configs[role] = config
                self._create_actors(role, config, pg, plan)
            self._setup_actors(plan)
            for role in roles:
                self._connect(role)
            if draft is not None:
                self._connect_laws()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------- start-up
    def _create_actors(self, role: Role, config: WorkerConfig, pg: Any, plan: PlacementPlan) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(WorkerProcess)
        size = len(plan.bundles(role))
        self._generation[role] = self._generation.get(role, 0) + 1
        # The workers inherit the environment of the node's raylet, not ours: forward our settings.
        env = {k: v for k, v in os.environ.items() if k.startswith("SPECSERVE_")}
        extra: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        self._actors[role] = [
            remote.options(num_cpus=0, num_gpus=1 if plan.use_gpu else 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=pg, placement_group_bundle_index=rank),
                           max_concurrency=4, **extra).remote(role, config, rank, size, self._secret)
            for rank in range(size)
        ]

    def _setup_actors(self, plan: PlacementPlan) -> None:
        """Each role's ranks join their own process group (rank 0's address) and load their shards."""
        roles = [role for role, actors in self._actors.items() if actors]
        check_worker_code(self._actors, roles)
        setups = {role: self._begin_setup(role, plan) for role in roles}
        for role, refs in setups.items():
            self._finish_setup(role, refs)

    def _begin_setup(self, role: Role, plan: PlacementPlan) -> list[Any]:
        import ray

        # Ranks on one machine meet on loopback: a local cluster is one machine, and the target's STRICT_PACK
        # group is always on one node (the draft's PACK group may span nodes).
        one_node = not self.parallel.address or role == Role.TARGET
        addr, port = ray.get(self._actors[role][0].address.remote(one_node))
        return [a.setup.remote(addr, port, plan.use_gpu) for a in self._actors[role]]

    def _finish_setup(self, role: Role, refs: list[Any]) -> None:
        import ray

        try:
            ray.get(refs)
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"starting the {role} workers failed: {e}") from e

    def _connect_laws(self) -> None:
        """The draft's laws go from draft rank 0 to target rank 0 (the verifier) on their own socket; again
        whenever either side was replaced."""
        import ray

        target, draft = self._actors[Role.TARGET][0], self._actors[Role.DRAFT][0]
        nodes = {w["node_id"] for w in ray.get([target.describe.remote(), draft.describe.remote()])}
        address = ray.get(target.serve_laws.remote(nodes == {ray.get_runtime_context().get_node_id()}))
        ray.get(draft.connect_laws.remote(address, first_tree_id(self._generation[Role.DRAFT])))
        self.endpoints["laws"] = [address]
        self._connect_features()  # an EAGLE head's features: the same pair, the other way

    def _connect_features(self) -> None:
        """An EAGLE head's features: target rank 0 to draft rank 0 (workers/eagle/features.py), loopback as the laws."""
        import ray

        config = self._configs[Role.DRAFT]
        if config.eagle_target is None:
            return
        target, draft = self._actors[Role.TARGET][0], self._actors[Role.DRAFT][0]
        address = ray.get(draft.serve_features.remote(self.endpoints["laws"][0].startswith("tcp://127.0.0.1")))
        ray.get(target.connect_features.remote(address, list(aux_layers_of(config))))

    def _connect(self, role: Role) -> None:
        """Watch the role's ranks; on the zmq transport, have them serve and connect to them."""
        import ray
        import zmq

        actors = self._actors[role]
        self._liveness.watch(role, actors)
        if self.parallel.transport != "zmq":
            return
        ctx = zmq.Context.instance()
        if self._reply is None:
            self._reply = ctx.socket(zmq.PULL)
        # Loopback only when the controller and all these workers share a machine: nothing else can reach them.
        here = ray.get_runtime_context().get_node_id()
        loopback = all(w["node_id"] == here for w in ray.get([a.describe.remote() for a in actors]))
        if loopback not in self._reply_addrs:
            host = "127.0.0.1" if loopback else node_ip()
            self._reply_addrs[loopback] = f"tcp://{host}:{self._reply.bind_to_random_port(f'tcp://{host}')}"
            self.endpoints["controller"] = list(self._reply_addrs.values())
        tag = self._tag(role)
        pushes = []
        endpoints = ray.get([a.serve.remote(self._reply_addrs[loopback], loopback, tag) for a in actors])
        for endpoint in endpoints:
            s = ctx.socket(zmq.PUSH)
            s.connect(endpoint)
            pushes.append(s)
        self._zmq[role] = pushes
        self.endpoints[role] = endpoints

    def _tag(self, role: Role) -> bytes:
        return f"{role}/{self._generation[role]}".encode()

    # ------------------------------------------------------------------------------------------- the hot path
    def _submit(self, role: Role, payload: bytes, op: bytes = OP_STEP) -> None:
        if role in self._in_flight:
            raise RuntimeError(f"a {role} call is already in flight")
        if self.parallel.transport == "zmq":
            frame = self._auth.seal([op, payload])  # once: every rank checks the same signature
            for s in self._zmq[role]:
                s.send_multipart(frame, copy=False)
            self._in_flight[role] = None
        else:
            method = "execute" if op == OP_STEP else "echo"
            self._in_flight[role] = [getattr(a, method).remote(payload) for a in self._actors[role]]

    def _wait(self, role: Role) -> Any:
        if role not in self._in_flight:
            raise RuntimeError(f"no {role} call in flight")
        refs = self._in_flight.pop(role)
        if self.parallel.transport == "zmq":
            return self._await_zmq(role)
        import ray

        # Short waits, asking between them whether every rank is alive: a dead rank 1 must not leave us
        # waiting on rank 0, blocked in a collective with it.
        deadline = time.monotonic() + self.step_timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    raise WorkerDiedError(role, refs.index(ref), died_because(ref),
                                          self.step_timeout_s - (deadline - time.monotonic())) from None
            self._liveness.check(role, self.step_timeout_s - (deadline - time.monotonic()))
            if role == Role.TARGET:
                self._watch_law_sender(self.step_timeout_s - (deadline - time.monotonic()))
            if pending and time.monotonic() > deadline:
                raise WorkerStuckError(role, self.step_timeout_s)
        decoded = [codec.decode(r) for r in ray.get(refs)]
        for r in decoded:
            if r.error is not None:
                self._worker_failed(role, r.error)
        return decoded[0].result

    def _await_zmq(self, role: Role) -> Any:
        """Rank 0's reply for ``role``; replies for the other role that arrive meanwhile are kept."""
        import zmq

        if role in self._replies:
            return self._replies.pop(role)
        roles = {self._tag(r): r for r in self._zmq}  # replies of a replaced (dead) generation are ignored
        start = time.monotonic()
        next_check = start + POLL_S
        while True:
            if self._reply.poll(timeout=int(POLL_S * 1000), flags=zmq.POLLIN):
                parts = self._auth.open(self._reply.recv_multipart(), 3)
                if parts is not None and parts[0] in roles:  # else: not signed by us, or stale; logged
                    tag, rank, payload = parts
                    reply: WorkerReply = codec.decode(payload)
                    if reply.error is not None:
                        self._worker_failed(roles[tag], reply.error)
                    if rank == b"0":
                        if roles[tag] == role:
                            return reply.result
                        self._replies[roles[tag]] = reply.result
            now = time.monotonic()
            if now >= next_check:  # also while the other role's replies keep arriving
                self._liveness.check(role, now - start)
                if role == Role.TARGET:
                    self._watch_law_sender(now - start)
                next_check = now + POLL_S
                if now - start > self.step_timeout_s:
                    raise WorkerStuckError(role, self.step_timeout_s)

    def _worker_failed(self, role: Role, error: str) -> None:
        """Raise a rank's error, unless it is the echo of another rank's death (a collective whose peer vanished
        fails at once, before Ray reports the death): then the death, which recovery can act on."""
        deadline = time.monotonic() + ERROR_GRACE_S
        while True:
            self._liveness.check(role)
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker failed:\n{error}")
            time.sleep(POLL_S / 2)

    def _watch_law_sender(self, waited_s: float) -> None:
        """While the target verifies, the draft's laws may still be on their way to it: if the draft died, tell
        the verifier now (a Ray call, whatever the transport: the actor serves it on another thread) that the
        trees its generation numbered will not come, so it stops waiting and answers at once."""
        if self._law_sender_died is not None or not self._actors[Role.DRAFT]:
            return
        try:
            self._liveness.check(Role.DRAFT, waited_s)
        except WorkerDiedError as e:
            self._law_sender_died = e
            # Every tree this generation (or an older one) numbered: below the next generation's first id.
            self._actors[Role.TARGET][0].fail_laws.remote(f"the draft worker that drew them died ({e})",
                                                       first_tree_id(self._generation[Role.DRAFT] + 1))

    def submit_draft(self, msg: DraftStep) -> None:
        self._submit(Role.DRAFT, codec.encode(msg))

    def wait_draft(self) -> DraftStepOutput:
        return self._wait(Role.DRAFT)

    def submit_target(self, msg: TargetStep) -> None:
        self._submit(Role.TARGET, codec.encode(msg))

    def wait_target(self) -> TargetStepOutput:
        out: TargetStepOutput = self._wait(Role.TARGET)
        if out.laws_error is not None:  # the step verified nothing: abandoned, like any step a worker died in
            died = self._law_sender_died
            if died is None:  # told by nobody: the verifier's last-resort timeout, or a death seen just now
                try:
                    self._liveness.check(Role.DRAFT)
                except WorkerDiedError as e:
                    died = e
            if died is None:
                raise RuntimeError(f"the target could not verify, although the draft worker is alive: "
                                   f"{out.laws_error}")
            raise died
        return out

    # ------------------------------------------------------------------------------------------- recovery
    def discard_in_flight(self, role: Role) -> None:
        """Forget a call to ``role`` that will never be answered (its worker died): nothing is waited for."""
        self._in_flight.pop(role, None)
        self._replies.pop(role, None)

    def in_flight(self) -> list[Role]:
        return list(self._in_flight)

    def begin_restart(self, role: Role) -> None:
        """Replace every rank of ``role`` (engine/execution/recovery.py): kill the old actors, place a fresh group and
        start new ones, which load their shards and form a new torch.distributed group in the background.
        The placement group is re-created, so a rank whose node is gone lands wherever the cluster has room."""
        self.discard_in_flight(role)
        if role == Role.DRAFT:
            self._law_sender_died = None  # the next generation's trees can arrive again
        self._close_role(role)
        self._kill_role(role)
        self._groups.remove([role])
        # What the cluster lacks is judged for this role alone: the other role keeps its bundles.
        try:
            (pg,) = self._groups.reserve(self.plan.only(role),
                                         {role: (self.plan.bundles(role), "STRICT_PACK")})
        except RuntimeError as e:
            raise RuntimeError(f"restarting the {role} workers: {e}") from None
        self._create_actors(role, self._configs[role], pg, self.plan)
        self._starting[role] = self._begin_setup(role, self.plan)

    def finish_restart(self, role: Role, block: bool) -> bool:
        """True once the restarted ``role`` is ready for calls (``block``: wait for it)."""
        import ray

        refs = self._starting.get(role)
        if refs is None:
            return True
        if not block:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            if len(done) < len(refs):
                return False
        del self._starting[role]
        self._finish_setup(role, refs)
        self._connect(role)
        if self._actors[Role.DRAFT] and self._actors[Role.TARGET] and not self._starting:
            self._connect_laws()
        return True

    def describe(self) -> list[dict[str, Any]]:
        """Every worker rank's role, rank, node, GPU ids and device."""
        import ray

        return ray.get([a.describe.remote() for actors in self._actors.values() for a in actors])

    def echo(self, role: Role, msg: Any) -> Any:
        """Round trip through the transport without running a model (overhead benchmark)."""
        self._submit(role, codec.encode(msg), OP_ECHO)
        return self._wait(role)

    # ------------------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        import ray

        for role in list(self._zmq):
            self._close_role(role)
        if self._reply is not None:
            self._reply.close(linger=0)
            self._reply = None
        self._reply_addrs = {}
        for role in list(self._actors):
            self._kill_role(role)
        self._groups.remove_all()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _close_role(self, role: Role) -> None:
        for s in self._zmq.pop(role, []):
            try:
                s.send_multipart(self._auth.seal([OP_STOP, b""]), flags=1)  # zmq.NOBLOCK
            except Exception:
                pass
            s.close(linger=0)
        self.endpoints.pop(role, None)

    def _kill_role(self, role: Role) -> None:
        import ray

        self._liveness.forget(role)
        for a in self._actors.get(role, []):
            try:
                ray.kill(a)
            except Exception:
                pass
        self._actors[role] = []
