"""What the server says about itself at ``/metrics``: speculative-decoding counters before and after a run, and
the queue (requests running and waiting) sampled during it.

Both specserve's names (``specserve:spec_decode_num_drafts_total``, ...) and vLLM's (``vllm:...``) are read;
samples that differ only in labels other than ``position`` (model name, engine index) are summed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("specserve:", "vllm:")
DRAFTS, DRAFT_TOKENS, ACCEPTED = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                  "spec_decode_num_accepted_tokens_total")
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
CHOSEN = "spec_decode_chosen_depth_total"  # specserve's only: rounds per depth its policy chose
RUNNING, WAITING = "num_requests_running", "num_requests_waiting"
PREFIX_QUERIES, PREFIX_HITS = "prefix_cache_queries_total", "prefix_cache_hits_total"  # prompt tokens (vLLM's)


@dataclass
class Snapshot:
    """Sums of the samples we read, by name without the server's prefix."""

    prefix: str | None = None  # "specserve:" or "vllm:", whichever the server exposes
    values: dict[str, float] = field(default_factory=dict)
    per_position: dict[int, float] = field(default_factory=dict)
    chosen_depths: dict[str, float] = field(default_factory=dict)

    @property
    def has_spec_decode(self) -> bool:
        return DRAFTS in self.values


def parse_metrics(text: str) -> Snapshot:
    snap = Snapshot()
    wanted = (DRAFTS, DRAFT_TOKENS, ACCEPTED, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            name = s.name[len(prefix):]
            if name in wanted:
                snap.prefix = snap.prefix or prefix
                snap.values[name] = snap.values.get(name, 0.0) + s.value
            elif name == PER_POS and "position" in s.labels:
                pos = int(s.labels["position"])
                snap.per_position[pos] = snap.per_position.get(pos, 0.0) + s.value
            elif name == CHOSEN and "depth" in s.labels:
                d = s.labels["depth"]
                snap.chosen_depths[d] = snap.chosen_depths.get(d, 0.0) + s.value
    return snap


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None
                 ) -> Snapshot | None:
    """None when the server has no readable /metrics."""
    try:
        r = await client.get(base_url + "/metrics", headers=headers)
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def spec_decode_delta(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """The run's speculation statistics from two snapshots, as vLLM defines them: acceptance rate = accepted /
    drafted tokens; mean acceptance length = 1 + accepted / drafts (tokens per verify round, the bonus or
    recovered token included); per-position rate = accepted at position i / drafts. None when the server
    exposes no speculative-decoding counters."""
    if before is None or after is None or not after.has_spec_decode:
        return None

    def d(name: str) -> float:
        return after.values.get(name, 0.0) - before.values.get(name, 0.0)

    drafts, drafted, accepted = d(DRAFTS), d(DRAFT_TOKENS), d(ACCEPTED)
    positions = sorted(after.per_position)
    per_pos = [after.per_position[p] - before.per_position.get(p, 0.0) for p in positions]
    chosen = {k: int(v - before.chosen_depths.get(k, 0.0)) for k, v in after.chosen_depths.items()}
    chosen = {k: chosen[k] for k in sorted(chosen, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
              if chosen[k] > 0}
    chains = {int(k): n for k, n in chosen.items() if k.isdigit()}
    return {
        "source": (after.prefix or "").rstrip(":"),
        "num_drafts": int(drafts),
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "accepted_per_position": [int(x) for x in per_pos],
        "per_position_acceptance_rate": [x / drafts for x in per_pos] if drafts else None,
        # the speculation policy's choices during the run (specserve): rounds per depth, plain decode as "0"
        "chosen_depths": chosen or None,
        "mean_chosen_depth": sum(k * n for k, n in chains.items()) / sum(chains.values()) if chains else None,
    }


class QueueSampler:
    """Polls /metrics every ``interval_s`` during a run; summarises requests running and waiting."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float,
                 headers: dict[str, str] | None = None):
        self.client, self.base_url, self.interval_s, self.headers = client, base_url, interval_s, headers
        self.running: list[float] = []
        self.waiting: list[float] = []
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            snap = await scrape(self.client, self.base_url, self.headers)
            if snap is not None and RUNNING in snap.values:
                self.running.append(snap.values[RUNNING])
                self.waiting.append(snap.values.get(WAITING, 0.0))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> dict[str, Any] | None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if not self.running:
            return None
        return {"samples": len(self.running), "interval_s": self.interval_s,
                "mean_running": sum(self.running) / len(self.running), "max_running": max(self.running),
                "mean_waiting": sum(self.waiting) / len(self.waiting), "max_waiting": max(self.waiting)}


def prefix_cache_delta(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """The run's prefix-cache lookups (prompt tokens queried and found cached) and hit rate; None when the server
    exposes no prefix-cache counters."""
    if before is None or after is None or PREFIX_QUERIES not in after.values:
        return None
    queries = after.values[PREFIX_QUERIES] - before.values.get(PREFIX_QUERIES, 0.0)
    hits = after.values.get(PREFIX_HITS, 0.0) - before.values.get(PREFIX_HITS, 0.0)
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries else None}
