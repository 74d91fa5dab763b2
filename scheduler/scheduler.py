"""Batch formation: which requests run this step, what each feeds, and KV admission (stdlib only).

Each step:
1. Running requests that finished prefill get a speculative round, its tree depth set by the speculation policy
   (scheduler/spec_policy.py). Their KV (target and draft) must cover the committed tokens, the in-flight tokens
   and exactly the tree nodes the target will verify; when the pool is short, the most recently arrived running
   request is preempted (blocks freed, recomputed later) until the rest fit.
2. Remaining token budget goes to prefill chunks: requests still prefilling first, then new arrivals, oldest
   first, as long as their blocks fit.

After the workers ran the batch, ``update_from_output`` applies its results: the scheduler is the only place
that moves a request's cache counters (``num_cached_target`` / ``num_cached_draft``).

Priority: ``Request.priority`` orders the waiting queue (lower first; arrival order within a priority), and a
waiting request that finds the running set full of lower-priority work (higher number) preempts the newest of
it. Batch jobs run at a lower priority than online requests this way, so interactive latency holds while a
job runs; preemption victims are always chosen lowest priority first.

Prefix caching (when the pools have it on; scheduler/prefix_cache.py, scheduler/block_manager.py): an admitted
request starts its target table with the longest run of cached full blocks of its prefix, never the block of
its last prefill token (the target must compute that token's logits), and its prefill starts there. The draft
starts at its own hit, at most the target's (the draft is fed the rest with its prefill chunk, or with its first
round when it prefills lazily). Blocks are offered to the cache once full and committed (``_register_cached``):
on the target every committed block; on the draft only prompt blocks, the positions it always writes in place
(its accepted tree nodes reach their slots only with its next call, which a finishing request never makes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import HashFn, PrefixCacheStats, chain_hashes, hash_block
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.spec_policy import SpecPolicy, branching_nodes


class VerifiedRound(Protocol):
    """What the scheduler reads of a verified round (workers/messages.py ``VerifyResult``)."""

    accepted_nodes: list[int]
    tokens: list[int]
    bonus: bool


class RoundSink(Protocol):
    """Totals over every request's rounds (engine/core/metrics.py ``SpecDecodingStats``)."""

    def record_round(self, drafted: int, accepted: int, emitted: int, bonus: bool,
                     branching: tuple[int, ...] = ()) -> None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in the running set
    max_num_batched_tokens: int = 2048  # prefill chunk tokens + tree nodes per step

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


@dataclass
class PrefillChunk:
    req: Request
    start: int  # first token position of the chunk (== req.num_cached_target)
    end: int  # one past the last

    @property
    def completes_prefill(self) -> bool:
        return self.end == self.req.prefill_end


@dataclass
class ScheduledBatch:
    prefills: list[PrefillChunk] = field(default_factory=list)
    rounds: list[Request] = field(default_factory=list)  # speculative (or plain decode) rounds
    depths: list[int] = field(default_factory=list)  # tree depth of each round (0: plain decode)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # branching of each round's tree (the policy's)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.rounds


class Scheduler:
    def __init__(self, config: SchedulerConfig, target_blocks: BlockManager, draft_blocks: BlockManager | None,
                 num_tree_nodes: int, draft_scratch_nodes: int | None = None, policy: SpecPolicy | None = None,
                 lazy_draft_prefill: bool = False) -> None:
        self.config = config
        self.target_blocks = target_blocks
        self.draft_blocks = draft_blocks
        self.num_tree_nodes = num_tree_nodes  # target scratch nodes per request per round (0: no speculation)
        # None (tests of the block accounting): every round reserves the full tree and reports depth 0.
        self.policy = policy
        # The draft may write more scratch than the target verifies (pipelining pre-drafts several trees).
        self.draft_scratch_nodes = num_tree_nodes if draft_scratch_nodes is None else draft_scratch_nodes
        # The draft does not see prompt chunks; a request's first speculative round feeds it the whole prefix
        # (its draft blocks are still reserved with the prompt's). An adaptive engine at saturation plans K = 0
        # for everyone, and then the draft's prefill is work for nothing (~4 % of a no-speculation step at b64).
        self.lazy_draft_prefill = lazy_draft_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_stats = PrefixCacheStats()
        self.hash_fn: HashFn = hash_block  # what names a block (tests/test_prefix_engine.py poisons it)
        if draft_blocks is not None and draft_blocks.block_size != target_blocks.block_size:
            raise ValueError("the target and draft pools must share a block size (one block hash serves both)")

    @property
    def capacity_slots(self) -> int:
        pools = [self.target_blocks] + ([self.draft_blocks] if self.draft_blocks is not None else [])
        return min(p.num_blocks * p.block_size for p in pools)

    def add(self, req: Request) -> None:
        need = len(req.prompt_token_ids) + req.params.max_tokens + max(self.num_tree_nodes, self.draft_scratch_nodes)
        if need > self.capacity_slots:
            raise ValueError(f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens "
                             f"({req.params.max_tokens}) + scratch nodes = {need} exceeds the "
                             f"KV cache capacity of {self.capacity_slots} tokens")
        self._enqueue(req)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into the waiting queue by priority: behind every request of the same priority (``front``: before)."""
        w = self.waiting
        i = len(w)
        while i > 0 and (w[i - 1].priority > req.priority or (front and w[i - 1].priority == req.priority)):
            i -= 1
        w.insert(i, req)

    def _victim(self) -> Request:
        """The running request to preempt: lowest priority first, then the most recent arrival."""
        return max(self.running, key=lambda r: (r.priority, r.stats.arrival_time, r.seq_id))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def depth(self, req: Request) -> int:
        return self.policy.depth(req.num_tokens, req.remaining_tokens) if self.policy is not None else 0

    def _round_nodes(self, shape: tuple[int, ...]) -> int:
        """Target scratch nodes of a round: the nodes it will verify."""
        return branching_nodes(shape) if self.policy is not None else self.num_tree_nodes

    def _draft_nodes(self, nodes: int) -> int:
        """Draft scratch nodes: the round's tree, or more when pipelining pre-drafts several trees."""
        return self.draft_scratch_nodes if self.draft_scratch_nodes > self.num_tree_nodes else nodes

    def _fits(self, req: Request, slots: int, draft_slots: int | None = None) -> bool:
        ok = self.target_blocks.can_reserve(req.seq_id, slots)
        if self.draft_blocks is not None:
            ok = ok and self.draft_blocks.can_reserve(req.seq_id, slots if draft_slots is None else draft_slots)
        return ok

    def _reserve(self, req: Request, slots: int, draft_slots: int | None = None) -> None:
        self.target_blocks.reserve(req.seq_id, slots)
        if self.draft_blocks is not None:
            self.draft_blocks.reserve(req.seq_id, slots if draft_slots is None else draft_slots)

    def _release(self, req: Request) -> None:
        self.target_blocks.free(req.seq_id)
        if self.draft_blocks is not None:
            self.draft_blocks.free(req.seq_id)

    def _preempt(self, req: Request) -> None:
        self._register_cached(req)  # its committed blocks stay cached: re-admitted, it finds them
        self._release(req)
        req.num_cached_target = 0
        req.num_cached_draft = 0
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self._enqueue(req, front=True)

    def schedule(self, held: Callable[[Request], bool] | None = None) -> ScheduledBatch:
        """``held``: running requests it is true for get no decode round this step (they keep their KV; prefill
        chunks still run). The engine holds seeded sampled requests while the draft is being replaced."""
        out = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for req in self.running:  # last step's commits (its tokens are emitted now)
            self._register_cached(req)
        # A full running set of lower-priority work yields one slot to a higher-priority arrival.
        if (self.waiting and len(self.running) >= self.config.max_num_seqs
                and self.waiting[0].priority < self._victim().priority):
            victim = self._victim()
            self._preempt(victim)
            out.preempted.append(victim)
        short_of_kv = False
        decoding = [r for r in self.running if not r.is_prefilling and not (held is not None and held(r))]
        # The policy shapes every round at once: the best depth of one request depends on the others' (they
        # share the verify and draft forwards).
        # Whether prompt chunks will share the step (running prefills, or room to admit an arrival): a step whose
        # time is mostly a prefill measures nothing of the decode sizes the policy would explore.
        prefill = (any(r.is_prefilling for r in self.running)
                   or (bool(self.waiting) and len(self.running) < self.config.max_num_seqs))
        shapes = ([()] * len(decoding) if self.policy is None
                  else self.policy.plan(decoding, prefill=prefill))
        for req, shape in zip(decoding, shapes, strict=True):
            if req.status is not RequestStatus.RUNNING:  # preempted below to make room for an older request
                continue
            nodes = self._round_nodes(shape)
            slots = req.num_tokens + nodes  # every token so far (committed + in flight) plus the tree
            draft_slots = req.num_tokens + self._draft_nodes(nodes)
            while not self._fits(req, slots, draft_slots):
                victim = self._victim()
                short_of_kv = True
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self._reserve(req, slots, draft_slots)
                out.rounds.append(req)
                out.depths.append(len(shape))
                out.shapes.append(tuple(shape))
                budget -= req.num_tokens - req.num_cached_target + nodes
        candidates = [r for r in self.running if r.is_prefilling]
        # No admissions in a step that had to preempt: the pool is short, and a victim re-admitted at once would
        # be recomputed now only to be preempted again by the next round (thrashing).
        while self.waiting and not short_of_kv and len(self.running) < self.config.max_num_seqs:
            # Admit in arrival order only while the head fits; skipping it would starve long prompts.
            head = self.waiting[0]
            if self._twin_prefilling(head):
                break
            hit = self._attach_cached(head)
            if not self._fits(head, min(head.prefill_end, hit + max(budget, 1))):
                self._detach_cached(head)
                break
            if self.target_blocks.enable_caching:
                self.prefix_stats.record(head.prefill_end, hit, head.num_cached_draft)
            self.waiting.popleft()
            head.status = RequestStatus.RUNNING
            self.running.append(head)
            candidates.append(head)
            if budget <= 0:
                break
        for req in candidates:
            if budget <= 0:
                break
            start = req.num_cached_target
            end = min(req.prefill_end, start + budget)
            if not self._fits(req, end):
                end = start + self._max_fit(req, start, end)
                if end <= start:
                    continue
            self._reserve(req, end)
            out.prefills.append(PrefillChunk(req, start, end))
            budget -= end - start
        # Requests held back from decoding: an empty batch is expected then, not a sign the pool is too small.
        waiting_on_hold = held is not None and any(held(r) for r in self.running if not r.is_prefilling)
        if out.empty and self.running and not out.preempted and not waiting_on_hold:
            if len(self.running) == 1:
                raise MemoryError("the KV cache is too small for even one request: raise num_kv_blocks "
                                  f"(target pool {self.target_blocks.num_blocks} blocks of "
                                  f"{self.target_blocks.block_size})")
            # Partly prefilled requests hold the whole pool between them: recompute the newest later.
            victim = self._victim()
            self._preempt(victim)
            return self.schedule()
        return out

    def _max_fit(self, req: Request, start: int, end: int) -> int:
        lo, hi = 0, end - start
        while lo < hi:  # largest chunk whose blocks fit
            mid = (lo + hi + 1) // 2
            if self._fits(req, start + mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self._register_cached(req)
        self._release(req)
        if self.policy is not None:
            self.policy.forget(req.seq_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # aborted before it ran (or while preempted)
            self.waiting.remove(req)

    # ---------------------------------------------------------------------------------------- prefix caching
    def _hashes(self, req: Request, num_blocks: int) -> list:
        """The request's block hashes, grown to ``num_blocks`` (no copy: registering runs every step)."""
        if len(req.block_hashes) < num_blocks:
            chain_hashes(req.all_token_ids, self.target_blocks.block_size, req.block_hashes, num_blocks,
                         hash_fn=self.hash_fn)
        return req.block_hashes

    def _attach_cached(self, req: Request) -> int:
        """Start a request that holds no blocks on its cached prefix; the target's hit in tokens."""
        # prompt logprobs need every prompt row's logits, which a cached prefix never computes (vLLM skips too)
        if (not self.target_blocks.enable_caching or req.seq_id in self.target_blocks.tables
                or req.params.prompt_logprobs is not None):
            return 0
        bs = self.target_blocks.block_size
        limit = (req.prefill_end - 1) // bs  # never the last prefill token's block
        hashes = self._hashes(req, limit)[:limit]
        n = self.target_blocks.match(hashes)
        self.target_blocks.attach(req.seq_id, hashes[:n])
        req.num_cached_target = n * bs
        if self.draft_blocks is not None:
            d = self.draft_blocks.match(hashes[:n])
            self.draft_blocks.attach(req.seq_id, hashes[:d])
            req.num_cached_draft = d * bs
        req.stats.num_cached_tokens = n * bs
        return n * bs

    def _twin_prefilling(self, req: Request) -> bool:
        """A copy of a prompt (n > 1: ``SamplingParams.after_twin``) whose twin, a running request with the same
        first block, is still prefilling: wait until the twin's blocks are committed and cached, then start on
        them instead of computing the same prefix again. The wait is one prefill: the twin progresses or leaves."""
        bs = self.target_blocks.block_size
        if not (req.params.after_twin and self.target_blocks.enable_caching and req.prefill_end > bs):
            return False
        first = req.prompt_token_ids[:bs]
        return any(r.is_prefilling and r.prompt_token_ids[:bs] == first for r in self.running)

    def _detach_cached(self, req: Request) -> None:
        """Undo ``_attach_cached`` for a request that stays waiting (its blocks go back to the LRU)."""
        self._release(req)
        req.num_cached_target = req.num_cached_draft = req.stats.num_cached_tokens = 0

    def _register_cached(self, req: Request) -> None:
        """Offer the request's full committed blocks to the cache (scratch and partial blocks never)."""
        if not self.target_blocks.enable_caching:
            return
        bs = self.target_blocks.block_size
        n_target = min(req.num_cached_target, req.num_tokens) // bs
        n_draft = min(req.num_cached_draft, len(req.prompt_token_ids)) // bs if self.draft_blocks is not None else 0
        hashes = self._hashes(req, max(n_target, n_draft))
        self.target_blocks.register(req.seq_id, hashes, n_target)
        if self.draft_blocks is not None:
            self.draft_blocks.register(req.seq_id, hashes, n_draft)

    def update_from_output(self, batch: ScheduledBatch, results: Sequence[VerifiedRound], num_drafted: Sequence[int],
                           num_cached_draft: Mapping[int, int], totals: RoundSink | None = None) -> None:
        """Apply one step's results, before its tokens are emitted (results: one per round, in order): the one
        sink of a round's outcome, for the request's counters and statistics, the policy's acceptance estimates
        and the engine's totals (``totals``).

        Prefill chunks become committed. A round commits its in-flight tokens and its accepted path on the
        target; the draft's committed length is what the drafter reports (it follows the draft's own scratch).
        The target's scratch blocks past the committed tokens are given back; the draft's stay: the draft
        applies its commit at the start of its next step, reading the nodes from their scratch slots, and
        trimmed blocks could be handed to another request before then.
        """
        for c in batch.prefills:
            c.req.num_cached_target = c.end
            if self.draft_blocks is not None and not self.lazy_draft_prefill:
                c.req.num_cached_draft = c.end
        for req, shape, res, drafted in zip(batch.rounds, batch.shapes, results, num_drafted, strict=True):
            req.num_cached_target = req.num_tokens + len(res.accepted_nodes)
            req.num_cached_draft = num_cached_draft.get(req.seq_id, req.num_cached_draft)
            req.stats.record_round(drafted, len(res.accepted_nodes), len(res.tokens), res.bonus)
            if totals is not None:
                totals.record_round(drafted, len(res.accepted_nodes), len(res.tokens), res.bonus,
                                    branching=shape if drafted else ())
            if self.policy is not None:  # a plain round too: the request's acceptance evidence ages
                self.policy.observe_round(req, shape if drafted else (), len(res.accepted_nodes) if drafted else 0)
            self.target_blocks.trim(req.seq_id, req.num_cached_target)
