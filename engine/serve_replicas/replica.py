"""``EngineReplica``: one engine (its own workers) behind a Serve deployment; the ingress streams from it.

Each replica is the server's engine loop (``AsyncEngine``) without the HTTP front end: ``generate`` yields the
engine's deltas for one request, ``stats`` reports what the ingress aggregates on ``/metrics``. On CPU a replica
may be pinned to one core (``cores``: replica *i* on this node takes ``cores[i % len(cores)]``), so N replicas
on N cores do not contend. A replica that Serve stops (scale-down, a redeploy) stops taking requests and gets
``graceful_shutdown_timeout_s`` for its open streams before the engine is shut down.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from engine.serve_replicas.wire import Accepted, ReplicaError, ReplicaRequest, ReplicaStats
from engine.server.streams import EngineUnavailableError, QueueFullError

logger = logging.getLogger("specserve.replicas")


class ResumableEngine:
    """The engine as the loop thread sees it, plus resumption: a request another replica began enters with the
    tokens it already streamed (``output_token_ids``); everything else is the engine's own."""

    def __init__(self, engine: Any, resume: dict[str, list[int]]) -> None:
        self._engine = engine
        self.resume = resume  # written by the front end before it queues the add; shared by rebuilt engines

    def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> Any:
        done = self.resume.pop(request_id, None)
        if done:
            kw["output_token_ids"] = done
        return self._engine.add_request(request_id, prompt, params, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class EngineReplica:
    async def __init__(self, engine_args: Any, served_model_name: str, max_queue: int = 256,
                   cores: tuple[int, ...] | None = None) -> None:
        from ray import serve

        from engine.core.llm_engine import LLMEngine
        from engine.server.async_engine import AsyncEngine
        from engine.server.metrics import ServerMetrics

        ctx = serve.get_replica_context()
        self.replica_id: str = ctx.replica_id.unique_id
        if cores:
            core = cores[ctx.rank.local_rank % len(cores)]
            os.sched_setaffinity(0, {core})  # before the engine starts its threads: they inherit it
            logger.info("replica %s pinned to core %d", self.replica_id, core)
        config = engine_args.to_engine_config()
        self.metrics = ServerMetrics(served_model_name)
        self.resume: dict[str, list[int]] = {}
        self.engine = AsyncEngine(ResumableEngine(LLMEngine.create(config), self.resume), max_queue=max_queue,
                                  metrics=self.metrics,
                                  engine_factory=lambda: ResumableEngine(LLMEngine.create(config), self.resume))
        self.engine.start()
        self.requests = 0

    async def generate(self, req: ReplicaRequest) -> AsyncIterator[Any]:
        self.requests += 1
        if req.output_token_ids:
            self.resume[req.request_id] = list(req.output_token_ids)
        try:
            stream = await self.engine.add_request(req.request_id, list(req.prompt_token_ids), req.params,
                                                   priority=req.priority)
        except QueueFullError as e:
            yield ReplicaError("overloaded", str(e), e.retry_after_s)
            return
        except EngineUnavailableError as e:
            yield ReplicaError("unavailable", str(e))
            return
        except ValueError as e:
            yield ReplicaError("invalid", str(e))
            return
        finally:
            self.resume.pop(req.request_id, None)
        yield Accepted(self.replica_id)
        try:
            async for delta in stream:
                if delta.finished:
                    yield ReplicaStats(self.replica_id, self.engine.stats)
                yield delta
        except EngineUnavailableError as e:
            yield ReplicaError("unavailable", str(e))
        finally:  # the ingress went away (client gone, cancelled): free the slot
            if not stream.finished:
                self.engine.abort(req.request_id)

    def stats(self) -> dict[str, Any]:
        """This replica's load and counters (the ingress labels them with ``replica``)."""
        s = self.engine.stats
        return {"replica": self.replica_id, "pid": os.getpid(), "requests": self.requests,
                "running": s.num_running, "waiting": self.engine.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "health": self.engine.health().status}

    def info(self) -> dict[str, Any]:
        """What the ingress needs once: the limits ``Serving`` checks requests against."""
        return {"max_model_len": self.engine.max_model_len, "max_num_seqs": self.engine.max_num_seqs,
                "vocab_size": self.engine.vocab_size, "max_queue": self.engine.max_queue}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    def check_health(self) -> None:
        """Serve restarts a replica whose engine is down for good (its restarts spent)."""
        if self.engine.dead_error is not None:
            raise RuntimeError(f"engine down: {self.engine.health().reason}")

    async def __del__(self) -> None:
        await self.engine.shutdown()
