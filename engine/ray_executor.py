"""Workers in Ray actors: the draft on its own bundle(s), the target's tensor-parallel ranks packed on one node.

Ray does placement, lifecycle and health; the per-round messages go over zmq as msgpack frames (or, with
``transport="ray"``, as plain actor calls — kept for comparison: see engine/benchmarks/transport.py). The
draft's laws take a third path, draft rank 0 straight to target rank 0 (``_connect_laws``): the controller
sends and receives ints only.
"""

from __future__ import annotations

import os
import time
from typing import Any

from engine import codec
from engine.config import ParallelConfig
from engine.placement import PlacementPlan, missing_resources, plan_placement
from engine.worker_actor import OP_ECHO, OP_STEP, OP_STOP, WorkerProcess, node_ip
from workers.messages import DraftStep, DraftStepOutput, TargetStep, TargetStepOutput, WorkerReply
from workers.worker_config import WorkerConfig

STEP_TIMEOUT_S = float(os.environ.get("SPECSERVE_STEP_TIMEOUT_S", "600"))


class RayExecutor:
    def __init__(self, parallel: ParallelConfig, target: WorkerConfig, draft: WorkerConfig | None) -> None:
        import ray

        self.parallel = parallel
        self._started_ray = False
        self._groups: list[Any] = []
        self._actors: dict[str, list[Any]] = {"target": [], "draft": []}
        self._zmq: dict[str, list[Any]] = {}
        self._reply = None
        self._in_flight: dict[str, Any] = {}  # role -> Ray refs (ray transport) or None (zmq)
        self._replies: dict[str, Any] = {}  # zmq replies that arrived while waiting for the other role
        try:
            if not ray.is_initialized():
                self._init_ray(parallel, draft is not None)
            plan = plan_placement(parallel.tensor_parallel_size, parallel.draft_tensor_parallel_size,
                                  draft is not None, ray.cluster_resources().get("GPU", 0.0))
            self.plan = plan
            roles = {"target": (target, plan.target_bundles, "STRICT_PACK")}
            if draft is not None:
                # The draft's own ranks (if any) need a fast link among themselves too; the draft as a whole
                # may still sit on another node than the target.
                roles["draft"] = (draft, plan.draft_bundles, "STRICT_PACK")
            # Every bundle is reserved before any worker starts, so a plan the cluster cannot hold fails
            # within placement_timeout_s without loading a model first; then both roles start side by side.
            groups = self._reserve(plan, [(bundles, strategy) for _, bundles, strategy in roles.values()])
            for (role, (config, _, _)), pg in zip(roles.items(), groups, strict=True):
                self._create_actors(role, config, pg, plan)
            self._setup_actors(plan)
            if draft is not None:
                self._connect_laws()
            if parallel.transport == "zmq":
                self._start_zmq()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------- start-up
    def _init_ray(self, parallel: ParallelConfig, has_draft: bool) -> None:
        import ray

        if parallel.address:
            ray.init(address=parallel.address, log_to_driver=False)
        else:
            # A local cluster must offer one CPU bundle per worker even on a 2-core machine: bundles are
            # reservations, and these workers mostly wait on each other. address="local": without it,
            # ray.init joins any cluster `ray start` left on this machine (and refuses num_cpus there).
            bundles = parallel.tensor_parallel_size + (parallel.draft_tensor_parallel_size if has_draft else 0)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, bundles), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        self._started_ray = True

    def _reserve(self, plan: PlacementPlan, specs: list[tuple[list[dict[str, float]], str]]) -> list[Any]:
        """One placement group per role (target first: its STRICT_PACK group is the harder one to place)."""
        import ray
        from ray.util.placement_group import placement_group

        groups = []
        for bundles, strategy in specs:
            pg = placement_group(bundles, strategy=strategy)
            self._groups.append(pg)
            groups.append(pg)
        timeout = self.parallel.placement_timeout_s
        try:
            ray.get([pg.ready() for pg in groups], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._remove_groups()
            raise RuntimeError(_placement_error(plan, timeout)) from None
        return groups

    def _create_actors(self, role: str, config: WorkerConfig, pg: Any, plan: PlacementPlan) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(WorkerProcess)
        size = len(plan.target_bundles if role == "target" else plan.draft_bundles)
        # The workers inherit the environment of the node's raylet, not ours: forward our settings.
        env = {k: v for k, v in os.environ.items() if k.startswith("SPECSERVE_")}
        extra: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        self._actors[role] = [
            remote.options(num_cpus=0, num_gpus=1 if plan.use_gpu else 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=pg, placement_group_bundle_index=rank),
                           max_concurrency=4, **extra).remote(role, config, rank, size)
            for rank in range(size)
        ]

    def _setup_actors(self, plan: PlacementPlan) -> None:
        """Each role's ranks join their own process group (rank 0's address) and load their shards."""
        import ray

        roles = [role for role, actors in self._actors.items() if actors]
        addresses = ray.get([self._actors[role][0].address.remote() for role in roles])
        setups = {role: [a.setup.remote(addr, port, plan.use_gpu) for a in self._actors[role]]
                  for role, (addr, port) in zip(roles, addresses, strict=True)}
        for role, refs in setups.items():
            try:
                ray.get(refs)
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"starting the {role} workers failed: {e}") from e

    def _connect_laws(self) -> None:
        """The draft's laws go from draft rank 0 to target rank 0 (the verifier) on their own socket."""
        import ray

        address = ray.get(self._actors["target"][0].serve_laws.remote())
        ray.get(self._actors["draft"][0].connect_laws.remote(address))

    def _start_zmq(self) -> None:
        import ray
        import zmq

        ctx = zmq.Context.instance()
        self._reply = ctx.socket(zmq.PULL)
        port = self._reply.bind_to_random_port(f"tcp://{node_ip()}")
        addr = f"tcp://{node_ip()}:{port}"
        for role, actors in self._actors.items():
            pushes = []
            for endpoint in ray.get([a.serve.remote(addr) for a in actors]):
                s = ctx.socket(zmq.PUSH)
                s.connect(endpoint)
                pushes.append(s)
            self._zmq[role] = pushes

    # ------------------------------------------------------------------------------------------- the hot path
    def _submit(self, role: str, payload: bytes, op: bytes = OP_STEP) -> None:
        if role in self._in_flight:
            raise RuntimeError(f"a {role} call is already in flight")
        if self.parallel.transport == "zmq":
            for s in self._zmq[role]:
                s.send_multipart([op, payload], copy=False)
            self._in_flight[role] = None
        else:
            method = "execute" if op == OP_STEP else "echo"
            self._in_flight[role] = [getattr(a, method).remote(payload) for a in self._actors[role]]

    def _wait(self, role: str) -> Any:
        if role not in self._in_flight:
            raise RuntimeError(f"no {role} call in flight")
        refs = self._in_flight.pop(role)
        if self.parallel.transport == "zmq":
            return self._await_zmq(role)
        import ray

        try:
            decoded = [codec.decode(r) for r in ray.get(refs, timeout=STEP_TIMEOUT_S)]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"no reply from the {role} workers within {STEP_TIMEOUT_S:g} s") from None
        for r in decoded:
            if r.error is not None:
                raise RuntimeError(f"worker failed:\n{r.error}")
        return decoded[0].result

    def _await_zmq(self, role: str) -> Any:
        """Rank 0's reply for ``role``; replies for the other role that arrive meanwhile are kept."""
        import zmq

        if role in self._replies:
            return self._replies.pop(role)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            if self._reply.poll(timeout=1000, flags=zmq.POLLIN):
                got_role, rank, payload = self._reply.recv_multipart()
                reply: WorkerReply = codec.decode(payload)
                if reply.error is not None:
                    raise RuntimeError(f"worker failed:\n{reply.error}")
                if rank != b"0":
                    continue
                if got_role.decode() == role:
                    return reply.result
                self._replies[got_role.decode()] = reply.result
            elif time.monotonic() > deadline:
                raise TimeoutError(f"no reply from the {role} workers within {STEP_TIMEOUT_S:g} s")

    def submit_draft(self, msg: DraftStep) -> None:
        self._submit("draft", codec.encode(msg))

    def wait_draft(self) -> DraftStepOutput:
        return self._wait("draft")

    def submit_target(self, msg: TargetStep) -> None:
        self._submit("target", codec.encode(msg))

    def wait_target(self) -> TargetStepOutput:
        return self._wait("target")

    def describe(self) -> list[dict[str, Any]]:
        """Every worker rank's role, rank, node, GPU ids and device."""
        import ray

        return ray.get([a.describe.remote() for actors in self._actors.values() for a in actors])

    def echo(self, role: str, msg: Any) -> Any:
        """Round trip through the transport without running a model (overhead benchmark)."""
        self._submit(role, codec.encode(msg), OP_ECHO)
        return self._wait(role)

    # ------------------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        import ray

        for pushes in self._zmq.values():
            for s in pushes:
                try:
                    s.send_multipart([OP_STOP, b""], flags=1)  # zmq.NOBLOCK
                except Exception:
                    pass
                s.close(linger=0)
        self._zmq = {}
        if self._reply is not None:
            self._reply.close(linger=0)
            self._reply = None
        for actors in self._actors.values():
            for a in actors:
                try:
                    ray.kill(a)
                except Exception:
                    pass
        self._actors = {"target": [], "draft": []}
        self._remove_groups()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self._groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._groups = []


def _placement_error(plan: PlacementPlan, timeout: float) -> str:
    """Why the plan could not be placed: what the cluster lacks in total, or else that others hold it."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    res = plan.resource
    why = missing_resources(plan, total, nodes)
    if why is None:
        free = ray.available_resources().get(res, 0.0)
        why = (f"the cluster has enough {res} in total but only {free:g} free: other jobs or engines hold the "
               "rest")
    return (f"could not place the workers within {timeout:g} s: {why}. Needed: {plan.describe()}. Cluster: "
            f"{total.get('CPU', 0.0):g} CPU, {total.get('GPU', 0.0):g} GPU on {len(nodes)} node(s). Lower "
            "tensor_parallel_size / draft_tensor_parallel_size, or add nodes.")
