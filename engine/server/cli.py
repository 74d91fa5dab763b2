"""``specserve serve``: the engine behind an OpenAI-compatible HTTP server.

Takes the same engine flags as ``specserve generate`` (one definition), plus the server's own. Once it
accepts connections it prints exactly one line to stdout, ``specserve: serving on http://HOST:PORT``
(``--port 0`` picks a free port and prints it); logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import socket
import sys

DEFAULT_SERVED_NAME = "specserve-default"  # the built-in pair's name in /v1/models


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from engine.core.args import EngineArgs

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    EngineArgs.add_cli_args(p)  # the same engine flags as `specserve generate`
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but a loopback address needs --api-key (or SPECSERVE_API_KEY)")
    p.add_argument("--port", type=int, default=8000, metavar="N", help="0 picks a free port (printed when ready)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSERVE_API_KEY, if set)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help=f"the model name clients send (default: --target as given, or {DEFAULT_SERVED_NAME!r})")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a running slot; beyond it the server answers 429 with "
                        "Retry-After")
    p.add_argument("--retry-after", type=float, default=1.0, metavar="SECONDS",
                   help="seconds suggested in 429 Retry-After")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the Batch API keeps its files and job store (SQLite); jobs left unfinished there "
                        "resume on start (default: the user data directory's 'specserve' folder)")
    p.add_argument("--batch-max-in-flight", type=int, default=None, metavar="N",
                   help="batch-job requests in the engine at once (default: 2 x --max-num-seqs); fewer keeps online "
                        "latency lower while a job runs, at the job's expense")
    p.add_argument("--max-engine-restarts", type=int, default=3, metavar="N",
                   help="times per 10 minutes the server rebuilds an engine that failed beyond recovery (worker "
                        "restarts exhausted, an unexpected error), re-admitting open requests; then /health "
                        "answers 503 with the reason (default: 3)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, metavar="N",
                   help="largest request body (JSON) accepted; larger ones get 413 before they are read "
                        "(default: 8 MiB)")
    p.add_argument("--max-upload-bytes", type=int, default=512 * 2**20, metavar="N",
                   help="largest /v1/files upload (default: 512 MiB)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a client must send its request headers within this; else it is dropped (default: 10)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a client must send its whole body within this after the headers; else it is dropped "
                        "(default: 60; raise it for large uploads over slow links)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request (to stderr)")
    from engine.serve_replicas.serve_cli import add_replica_args

    add_replica_args(p)  # --replicas N: the same server as N engines behind one endpoint on Ray Serve
    p.set_defaults(func=cmd_serve)
    return p


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model: a taken port fails in a second, not after a minute of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def _log_config(level: str) -> dict:
    """uvicorn's logging, all on stderr: stdout carries only the 'serving on' line."""
    import uvicorn.config

    cfg = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for handler in cfg["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    cfg["loggers"]["specserve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from engine.serve_replicas.serve_cli import cmd_serve_replicas

        return cmd_serve_replicas(args)
    import uvicorn

    from engine.core.args import EngineArgs
    from engine.core.llm_engine import LLMEngine
    from engine.server.app import build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.auth import resolve_api_key, tenant_of
    from engine.server.limits import ServerLimits, limited_protocol
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServerConfig
    from workers.loader import load_tokenizer

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts must be >= 0, got {args.max_engine_restarts}")
    limits = ServerLimits(args.max_body_bytes, args.max_upload_bytes, args.header_timeout, args.body_timeout)
    api_key = resolve_api_key(args.host, args.api_key)  # refuse an open bind before anything is loaded
    sock = _bind(args.host, args.port)
    from engine.jobs.store import JobStore, default_data_dir
    from engine.server.batches import batch_router

    job_store = JobStore(args.data_dir or default_data_dir())  # an unusable data dir fails before the model loads
    job_store.claim()  # a second server on the same directory is refused here, before its model loads
    config = EngineArgs.from_cli_args(args).to_engine_config()
    name = args.served_model_name or (args.target if args.target is not None else DEFAULT_SERVED_NAME)
    config.tenant = tenant_of(api_key, name)  # the suffix cache's scope; the key itself is not kept
    engine = LLMEngine.create(config)
    try:
        metrics = ServerMetrics(name)
        collector = None
        if engine.recovery is not None:  # Ray workers: restarts and recovery time next to the serving metrics
            from engine.execution.recovery import RecoveryCollector

            collector = RecoveryCollector(engine.recovery.stats)
            metrics.registry.register(collector)

        def on_new_engine(new: LLMEngine) -> None:  # a rebuilt engine's worker restarts count from zero
            if collector is not None and new.recovery is not None:
                collector.stats = new.recovery.stats

        async_engine = AsyncEngine(engine, max_queue=args.max_queue, retry_after_s=args.retry_after,
                                   metrics=metrics, engine_factory=lambda: LLMEngine.create(config),
                                   max_engine_restarts=args.max_engine_restarts, on_new_engine=on_new_engine)
        tokenizer = load_tokenizer(config.tokenizer or config.target)
        # Twice the running set in flight by default: the engine stays full of batch work, its waiting queue short.
        batches = batch_router(job_store, max_in_flight=args.batch_max_in_flight or 2 * config.scheduler.max_num_seqs)
        app = build_app(async_engine, ServerConfig(name, os.path.abspath(config.target)), tokenizer,
                        api_key=api_key, extra_routers=[batches], limits=limits)
    except BaseException:
        engine.shutdown()
        raise
    server = uvicorn.Server(uvicorn.Config(app, log_config=_log_config(args.log_level), log_level=args.log_level,
                                           access_log=args.access_log, timeout_graceful_shutdown=5,
                                           http=limited_protocol(limits.header_timeout_s, metrics.count_slow_client)))
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        asyncio.run(_serve(server, sock, url))
    finally:
        if not async_engine.started:  # the loop thread owns (and shuts down) the engine once it has started
            engine.shutdown()
    return 0


async def _serve(server, sock: socket.socket, url: str) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        print(f"specserve: serving on {url}", flush=True)
    await task
    if not server.started:
        print("specserve: error: the server did not start (see the log above)", file=sys.stderr)
