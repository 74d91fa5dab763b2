"""Prometheus metrics of the service, named like vLLM's so its dashboards work after a prefix change.

Two concerns, two types:
- ``EngineStats``: a snapshot of the engine (queue lengths, KV use, cumulative speculation counters) that the
  engine loop thread reads after every step — the only place that looks inside the engine;
- ``ServerMetrics``: one private ``CollectorRegistry`` (two servers in one process do not collide) holding the
  counters, gauges and histograms, fed from snapshots and from each request's deltas.

Cumulative engine counters become Prometheus counters by adding the difference between two snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "specserve:"

# vLLM's buckets (seconds), so histograms line up with existing dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0  # queued inside the engine's scheduler
    kv_cache_usage: float = 0.0  # fraction of the target's KV blocks in use, 0..1
    num_drafts: int = 0  # verify rounds that carried candidates
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [depth] -> rounds that accepted a token at that depth
    # rounds per shape the speculation policy chose ("0": plain decode, "4": a chain of 4, "tree:2x1")
    chosen_depths: tuple[tuple[str, int], ...] = ()
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (scheduler/prefix_cache.py)
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # per drafting source ("ngram", "suffix", "draft_model"): (source, rounds, proposed, accepted), cumulative
    by_source: tuple[tuple[str, int, int, int], ...] = ()


def read_engine_stats(engine: Any) -> EngineStats:
    """Snapshot of an ``LLMEngine``; called on the engine loop thread only (it owns the engine)."""
    sched = engine.scheduler
    blocks = sched.target_blocks
    spec = engine.stats  # SpecDecodingStats
    return EngineStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_cache_usage=1.0 - blocks.num_free / blocks.num_blocks,
        num_drafts=spec.num_rounds, num_draft_tokens=spec.num_drafted, num_accepted_tokens=spec.num_accepted,
        accepted_per_position=tuple(spec.accepted_per_position),
        chosen_depths=tuple(spec.chosen_depths.items()),
        prefix_cache_queries=sched.prefix_stats.queries, prefix_cache_hits=sched.prefix_stats.hits,
        by_source=tuple((k, v.num_rounds, v.num_drafted, v.num_accepted) for k, v in spec.by_source.items()))


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: list[str] = m) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, m, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests accepted but not yet running (engine queue "
                                                     "plus those on their way to it).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the target's KV-cache blocks in use (1 = 100%).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.drafts = counter("spec_decode_num_drafts", "Verify rounds that carried draft candidates.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft candidate tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft candidate tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds that accepted a candidate at this depth (0 = first).",
                                        m + ["position"])
        self.chosen_depth = counter("spec_decode_chosen_depth", "Rounds run at each depth the speculation policy "
                                    "chose (0 = plain decode; tree:2x1 = a tree shape).", m + ["depth"])
        src = m + ["source"]
        self.source_drafts = counter("spec_decode_num_drafts_by_source", "Verify rounds whose candidates this "
                                     "drafting source proposed (ngram, suffix, draft_model).", src)
        self.source_draft_tokens = counter("spec_decode_num_draft_tokens_by_source", "Candidate tokens this "
                                           "drafting source proposed.", src)
        self.source_accepted = counter("spec_decode_num_accepted_tokens_by_source", "Candidate tokens of this "
                                       "drafting source accepted.", src)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (prefill skipped).")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival at the server to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs of a request (a "
                             "speculative round delivers several tokens in one output).", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1) of "
                              "each finished request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival at the server to the last token.",
                             E2E_BUCKETS)
        self.success = counter("request_success", "Finished requests by finish reason (stop, length, abort).",
                               m + ["finished_reason"])
        self.errors = counter("request_errors", "Requests refused or failed, by kind (invalid_request, "
                              "overloaded, unauthorized, engine_dead, internal).", m + ["error"])
        self.engine_restarts = counter("engine_restarts", "Engines the server rebuilt after a step failed beyond "
                                       "the engine's own recovery (open requests re-admitted).")
        self.slow_clients = counter("slow_clients_dropped", "Connections dropped because the client did not send its "
                                    "request headers (--header-timeout) or body (--body-timeout) in time.",
                                    m + ["phase"])
        self._last = EngineStats()

    def engine_replaced(self) -> None:
        """A new engine's cumulative counters start from zero: count on from there."""
        self.engine_restarts.labels(self.model_name).inc()
        self._last = EngineStats()

    # ------------------------------------------------------------------------------------ from the engine loop
    def observe_stats(self, s: EngineStats) -> None:
        """Counters advance by what the engine's cumulative counters advanced since the last snapshot."""
        name, last = self.model_name, self._last
        self.kv_usage.labels(name).set(s.kv_cache_usage)
        self.running.labels(name).set(s.num_running)
        advances = [(self.drafts, (name,), s.num_drafts, last.num_drafts),
                    (self.draft_tokens, (name,), s.num_draft_tokens, last.num_draft_tokens),
                    (self.accepted_tokens, (name,), s.num_accepted_tokens, last.num_accepted_tokens),
                    (self.prefix_queries, (name,), s.prefix_cache_queries, last.prefix_cache_queries),
                    (self.prefix_hits, (name,), s.prefix_cache_hits, last.prefix_cache_hits)]
        before_pos = dict(enumerate(last.accepted_per_position))
        advances += [(self.accepted_per_pos, (name, str(pos)), now, before_pos.get(pos, 0))
                     for pos, now in enumerate(s.accepted_per_position)]
        before_depth = dict(last.chosen_depths)
        advances += [(self.chosen_depth, (name, depth), now, before_depth.get(depth, 0))
                     for depth, now in s.chosen_depths]
        before_src = {k: (r, d, a) for k, r, d, a in last.by_source}
        per_source = (self.source_drafts, self.source_draft_tokens, self.source_accepted)
        for k, *now in s.by_source:
            prev = before_src.get(k, (0, 0, 0))
            advances += [(metric, (name, k), n, b) for metric, n, b in zip(per_source, now, prev, strict=True)]
        for metric, labels, now, before in advances:
            if now > before:
                metric.labels(*labels).inc(now - before)
        self._last = s

    def observe_first_output(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def observe_output(self, new_tokens: int, since_last_s: float | None) -> None:
        if new_tokens:
            self.generation_tokens.labels(self.model_name).inc(new_tokens)
        if since_last_s is not None:
            self.itl.labels(self.model_name).observe(since_last_s)

    def observe_finished(self, reason: str, e2e_s: float, ttft_s: float | None, output_tokens: int) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_s)
        if ttft_s is not None and output_tokens > 1:
            self.tpot.labels(self.model_name).observe((e2e_s - ttft_s) / (output_tokens - 1))

    # ---------------------------------------------------------------------------------------- from the routes
    def count_error(self, kind: str) -> None:
        self.errors.labels(self.model_name, kind).inc()

    def count_slow_client(self, phase: str) -> None:
        """A client dropped for being too slow: ``phase`` is "headers" or "body"."""
        self.slow_clients.labels(self.model_name, phase).inc()

    def track_waiting(self, num_waiting: Callable[[], int]) -> None:
        """The waiting gauge is read at scrape time from the front end (it knows what is still in transit)."""
        self.waiting.labels(self.model_name).set_function(num_waiting)
