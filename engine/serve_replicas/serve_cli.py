"""``specserve serve --replicas N``: the replicated app on a local Ray (or ``--address``), in the foreground.

The flags are the one-engine server's, plus the replica set's own (added by ``add_replica_args``). It prints
``specserve: serving on http://HOST:PORT`` once ``/health`` answers through Serve's proxy, and on SIGTERM /
Ctrl-C deletes the app (replicas drain: ``graceful_shutdown_timeout_s``) and stops the Ray it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from engine.serve_replicas.routing import POLICIES, RoutingConfig

APP_NAME = "specserve"


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas behind one endpoint on Ray Serve (default: one engine, no Serve); "
                        "with --max-replicas, the initial count")
    g.add_argument("--routing", default="least_tokens", choices=POLICIES,
                   help="replica choice: fewest outstanding tokens, shared-prefix affinity, or round-robin")
    g.add_argument("--prefix-blocks", type=int, default=RoutingConfig.prefix_blocks, metavar="N",
                   help="full KV blocks that make the prefix-affinity key")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N", help="autoscaling floor")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscaling ceiling (turns autoscaling on)")
    g.add_argument("--target-ongoing-requests", type=float, default=4.0, metavar="N",
                   help="autoscaling aims at this many requests per replica")
    g.add_argument("--replica-cores", default=None, metavar="LIST",
                   help="pin replica i of a node to the i-th core of this comma list (CPU engines)")


def config_from_args(args: argparse.Namespace, api_key: str | None, port: int):
    from engine.core.args import EngineArgs
    from engine.serve_replicas.config import AutoscalingConfig, ReplicaAppConfig
    from engine.server.limits import ServerLimits

    engine = EngineArgs.from_cli_args(args)
    autoscaling = None
    if args.max_replicas is not None:
        autoscaling = AutoscalingConfig(min_replicas=args.min_replicas if args.min_replicas is not None else 1,
                                        max_replicas=args.max_replicas,
                                        target_ongoing_requests=args.target_ongoing_requests)
    cores = tuple(int(c) for c in args.replica_cores.split(",")) if args.replica_cores else None
    name = args.served_model_name or (args.target if args.target is not None else "specserve-default")
    return ReplicaAppConfig(
        engine=engine, served_model_name=name, replicas=args.replicas, autoscaling=autoscaling,
        routing=RoutingConfig(policy=args.routing, block_size=engine.block_size, prefix_blocks=args.prefix_blocks),
        cores=cores, host=args.host, port=port, api_key=api_key, max_queue=args.max_queue, data_dir=args.data_dir,
        batch_max_in_flight=args.batch_max_in_flight,
        limits=ServerLimits(args.max_body_bytes, args.max_upload_bytes, args.header_timeout, args.body_timeout))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the replicas did not become healthy within {timeout_s:.0f} s")


def cmd_serve_replicas(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from engine.execution.loopback import ray_on_loopback
    from engine.serve_replicas.app import build_app
    from engine.server.auth import resolve_api_key

    api_key = resolve_api_key(args.host, args.api_key)  # refuse an open bind before Ray starts
    port = args.port or _free_port(args.host)
    config = config_from_args(args, api_key, port)
    started_ray = not ray.is_initialized()
    if started_ray and args.address:
        ray.init(address=args.address, log_to_driver=False)
    elif started_ray:
        # Logical CPUs are reservations: each replica's own one, plus (CPU engines with Ray workers) a bundle per
        # target rank and one for the draft, as the one-engine server's local Ray does.
        workers = config.engine.tensor_parallel_size + 1 if config.engine.tensor_parallel_size > 1 else 0
        cpus = max(os.cpu_count() or 1, int(config.max_replicas * (config.replica_num_cpus + workers)))
        with ray_on_loopback():
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{port}"
        wait_healthy(url, args.placement_timeout_s + 120)
        print(f"specserve: serving on {url}", flush=True)
        stop.wait()
        serve.delete(APP_NAME)  # replicas drain their open streams (graceful_shutdown_timeout_s)
    except Exception as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if started_ray:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    return 0
