"""``build_app(args)``: the Ray Serve application, N engine replicas behind one OpenAI-compatible ingress.

```
client ─HTTP─▶ Serve proxy ─▶ Ingress (1 replica: the server's routes, auth, body limits, Batch API + job store)
                                 │ RoutedEngine: one pump per request; SpecserveRouter picks the replica
                                 ├─stream─▶ EngineReplica 1 (its own engine and workers)
                                 └─stream─▶ EngineReplica N
```

The ingress is the one-engine server's FastAPI app (``engine.server.app.build_app``) with ``RoutedEngine`` in
place of ``AsyncEngine``: the same endpoints, errors, streaming, API-key rule (loopback by default, a key for any
other host) and Batch API; the job store lives once, in the ingress (one replica, on a persistent volume on
Kubernetes), and its lines spread over the engine replicas like online requests. Use it from a Serve config
file as ``import_path: engine.serve_replicas.app:build_app`` with the ``ReplicaAppConfig`` fields as ``args``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from engine.serve_replicas.config import ReplicaAppConfig
from engine.serve_replicas.replica import EngineReplica
from engine.serve_replicas.router import SpecserveRouter

INGRESS_MAX_ONGOING = 100_000  # the ingress only relays: RoutedEngine bounds what it admits (429 beyond)


@serve.ingress()
class Ingress:
    async def __init__(self, replicas: Any, config: ReplicaAppConfig) -> None:
        from engine.server.auth import resolve_api_key

        self.config = config
        self.replicas = replicas
        self.api_key = resolve_api_key(config.host, config.api_key)  # an open bind without a key never starts
        self.info = await replicas.info.remote()

    def __serve_build_asgi_app__(self) -> Any:
        from engine.jobs.store import JobStore, default_data_dir
        from engine.serve_replicas.routed_engine import RoutedEngine
        from engine.server.app import build_app as build_server_app
        from engine.server.batches import batch_router
        from engine.server.metrics import ServerMetrics
        from engine.server.serving import ServerConfig
        from workers.loader import load_tokenizer

        cfg = self.config
        engine_config = cfg.engine.to_engine_config()  # resolves the built-in pair's paths; loads nothing
        store = JobStore(cfg.data_dir or default_data_dir())
        store.claim()  # a second ingress on the same store is refused: jobs must live once
        per_replica = self.info["max_num_seqs"] + self.info["max_queue"]
        self.engine = RoutedEngine(self.replicas, self.info, max_in_flight=cfg.max_replicas * per_replica,
                                   max_retries=cfg.max_retries, metrics=ServerMetrics(cfg.served_model_name))
        batches = batch_router(store, max_in_flight=cfg.batch_max_in_flight or 2 * self.info["max_num_seqs"])
        tokenizer = load_tokenizer(engine_config.tokenizer or engine_config.target)
        return build_server_app(self.engine, ServerConfig(cfg.served_model_name, os.path.abspath(engine_config.target)),
                                tokenizer, api_key=self.api_key, extra_routers=[batches], limits=cfg.limits)


def replica_deployment(config: ReplicaAppConfig) -> Any:
    """The engine replicas' deployment options: resources, routing, autoscaling or a fixed count, drain."""
    scheduler = config.engine.max_num_seqs
    options: dict[str, Any] = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": config.replica_num_cpus},
        # Serve keeps a replica's queue at most this deep; the engine's own queue (max_queue) answers 429 past it.
        "max_ongoing_requests": scheduler + config.max_queue,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 5.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=SpecserveRouter, request_router_kwargs=dataclasses.asdict(config.routing),
            request_routing_stats_period_s=2.0),
    }
    if config.autoscaling is not None:
        options["autoscaling_config"] = config.autoscaling.to_serve(config.replicas)
    else:
        options["num_replicas"] = config.replicas
    return serve.deployment(EngineReplica).options(**options)


def build_app(args: ReplicaAppConfig | dict[str, Any]) -> Any:
    """The Serve application (``serve.run(build_app(...))``, or a Serve config file's ``import_path``)."""
    from engine.server.auth import resolve_api_key

    config = args if isinstance(args, ReplicaAppConfig) else ReplicaAppConfig.from_dict(args)
    resolve_api_key(config.host, config.api_key)  # an open bind without a key fails here, before anything starts
    replicas = replica_deployment(config).bind(config.engine, config.served_model_name, config.max_queue,
                                               config.cores)
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0, "resources": dict(config.ingress_resources)})
    return ingress.bind(replicas, config)
