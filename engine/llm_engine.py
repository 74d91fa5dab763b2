"""The controller loop: schedule -> draft -> verify -> commit -> emit, with continuous batching.

Requests join between steps and leave when they finish; the scheduler decides who runs and reserves their KV.
The draft and target workers are called through typed messages, so the Ray executor can move them into
actors without touching this loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from dataclasses import dataclass

from engine.compat import check_draft_compatible
from engine.config import EngineConfig
from engine.executor import make_executor
from engine.faults import WorkerDiedError
from engine.metrics import SpecDecodingStats, StepTimes
from engine.pipeline import Pipeliner, sampling_spec
from engine.recovery import Recovery
from engine.stopping import StopChecker
from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request
from scheduler.reset import forget_draft_cache, requeue_all
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch, Scheduler
from workers.loader import load_tokenizer
from workers.messages import CommitSpec, DraftSeq, DraftStep, PrefillSeq, TargetStep, VerifySeq
from workers.model_config import ModelConfig
from workers.verification import CandidateTree
from workers.worker_config import WorkerConfig

_MAX_AUTO_KV_TOKENS = 1 << 17


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    finished: bool
    metrics: dict


class EngineDeadError(RuntimeError):
    """A step failed and could not be recovered (a worker raised or got stuck; workers died more often than
    max_worker_restarts allows; an in-process worker died): worker KV state and the controller's counters may
    disagree, so the engine refuses further work instead of producing wrong output. Create a new engine."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._dead: BaseException | None = None  # the failure that stopped this engine
        tcfg = ModelConfig.from_pretrained(config.target)
        self.max_model_len = min(config.max_model_len or tcfg.max_model_len, tcfg.max_model_len)
        self.tokenizer = load_tokenizer(config.tokenizer or config.target)
        spec = config.speculative
        if spec is not None:
            check_draft_compatible(config.target, spec.model, tcfg)
        self.tree = spec.tree_shape if spec is not None else None
        num_nodes = self.tree.num_nodes if self.tree is not None else 0
        bs = config.cache.block_size
        kv_tokens = config.cache.num_kv_tokens or min(
            config.scheduler.max_num_seqs * (self.max_model_len + num_nodes), _MAX_AUTO_KV_TOKENS)
        num_blocks = -(-kv_tokens // bs)
        draft_cfg = None
        if spec is not None:
            draft_cfg = WorkerConfig(spec.model, num_blocks, bs, config.dtype, config.device,
                                     tree_sampling=spec.tree_sampling, target_vocab_size=tcfg.vocab_size)
        self.has_draft = draft_cfg is not None
        self.draft_up = self.has_draft  # False while a dead draft is being replaced: no speculation then
        # Past its own context the draft still runs (RoPE is computed per position) but proposes poorly; like
        # vLLM, stop drafting for a sequence there instead of paying for rejected candidates.
        dcfg = ModelConfig.from_pretrained(spec.model) if spec is not None else None
        self.draft_max_len = dcfg.max_model_len if dcfg is not None else 0
        parallel = config.parallel
        if spec is not None and spec.draft_tensor_parallel_size != parallel.draft_tensor_parallel_size:
            parallel = dataclasses.replace(parallel, draft_tensor_parallel_size=spec.draft_tensor_parallel_size)
        # Refuse a size that does not divide the heads before any worker is placed or loads weights.
        tcfg.check_tp(parallel.tensor_parallel_size)
        if dcfg is not None:
            dcfg.check_tp(parallel.draft_tensor_parallel_size)
        self.executor = make_executor(parallel,
                                      WorkerConfig(config.target, num_blocks, bs, config.dtype, config.device),
                                      draft_cfg)
        self.vocab_size = tcfg.vocab_size
        self.eos_token_ids = set(tcfg.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, BlockManager(num_blocks, bs),
                                   BlockManager(num_blocks, bs) if spec is not None else None, num_nodes,
                                   draft_scratch_nodes=spec.draft_scratch_nodes if spec is not None else 0)
        self.stats = SpecDecodingStats()
        self.times = StepTimes()
        self.pipeline = (Pipeliner(self, spec.pipeline_width)
                         if spec is not None and spec.pipeline else None)
        self._seq_ids = itertools.count()
        self._stop: dict[int, StopChecker] = {}
        self._draft_commits: dict[int, CommitSpec] = {}
        self._finished_ids: list[int] = []
        # Ray workers can be replaced when they die; in-process ones die with us.
        self.recovery = (Recovery(self, parallel.max_worker_restarts, parallel.worker_restart_window_s)
                         if hasattr(self.executor, "begin_restart") else None)

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and queue; raises ValueError naming the field and the limit."""
        self._check_alive()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send prompt_token_ids instead")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens, the model's context is {self.max_model_len} "
                             "(prompt + at least one generated token must fit)")
        req = Request(next(self._seq_ids), str(request_id), token_ids, params)
        # Unseeded requests get a private random seed: every tensor-parallel rank then draws the same
        # candidates and uniforms without exchanging them, and no request's stream depends on another's.
        req.seed = params.seed if params.seed is not None else secrets.randbits(63)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        checker = StopChecker(stop_ids, params.stop, self.tokenizer)  # may refuse: before anything is queued
        self.scheduler.add(req)
        self._stop[req.seq_id] = checker
        return req

    def withdraw_queued(self, req: Request) -> None:
        """Take back a request that ``add_request`` queued and no step has scheduled yet."""
        self.scheduler.waiting.remove(req)
        self._stop.pop(req.seq_id, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def shutdown(self) -> None:
        """Stop the workers (Ray actors, sockets); the engine is unusable afterwards."""
        self.executor.shutdown()

    # ---------------------------------------------------------------------------------------------- the loop
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after a failed step ({type(self._dead).__name__}: "
                                  f"{self._dead}); create a new engine") from self._dead

    def step(self) -> list[RequestOutput]:
        """One round for every scheduled request; returns the requests that finished in it."""
        self._check_alive()
        try:
            try:
                if self.recovery is not None:
                    self.recovery.poll()
                return self._step()
            except WorkerDiedError as e:
                if self.recovery is None:
                    raise
                self.recovery.recover(e)  # the step is abandoned; its requests go on from what they had
                return []
        except BaseException as e:
            self._dead = e
            raise

    # ------------------------------------------------------------------------------------- worker recovery
    def lose_worker_state(self, role: str) -> None:
        """``role``'s workers were replaced and their caches are empty: start over from the requests' tokens."""
        for req in self.scheduler.running:
            self._forget_draft_state(req.seq_id)
        if role == "target":
            requeue_all(self.scheduler)
        else:
            forget_draft_cache(self.scheduler)
            self.draft_up = False

    def resume_draft(self) -> None:
        """A replaced draft is up: fill its cache with every running request's committed tokens, speculate again."""
        prefills = [PrefillSeq(r.seq_id, self._draft_table(r), 0, r.all_token_ids[: r.num_cached_target])
                    for r in self.scheduler.running if r.num_cached_target > 0]
        if prefills:
            self.executor.submit_draft(DraftStep(prefills=prefills))
            self.executor.wait_draft()
        for r in self.scheduler.running:
            r.num_cached_draft = r.num_cached_target
        self.draft_up = True

    def _step(self) -> list[RequestOutput]:
        times = self.times
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            self._forget_draft_state(req.seq_id)
        finished_ids = self._take_finished()
        pipe = self.pipeline if self.draft_up else None
        t1 = time.perf_counter()
        trees = pipe.trees_for(batch, finished_ids) if pipe else self._draft(batch, finished_ids)
        t2 = time.perf_counter()
        self.executor.submit_target(self._target_step(batch, trees, finished_ids))
        if pipe:
            pipe.predraft(batch, trees)  # the draft works on round r+1 while the target verifies round r
        out = self.executor.wait_target()
        t3 = time.perf_counter()
        if pipe:
            pipe.target_done(out.elapsed_s)
        finished = self._commit_prefills(batch, out.first_tokens)
        finished += self._commit_rounds(batch, trees, out.results)
        t4 = time.perf_counter()
        if pipe:
            pipe.collect(batch)
        t5 = time.perf_counter()
        times.record(schedule_s=t1 - t0, draft_wall_s=t2 - t1, verify_wall_s=t3 - t2, verify_s=out.elapsed_s,
                     commit_s=t4 - t3, collect_s=t5 - t4)
        return [self._output(r) for r in finished]

    def _forget_draft_state(self, seq_id: int) -> None:
        self._draft_commits.pop(seq_id, None)
        if self.pipeline is not None:
            self.pipeline.forget(seq_id)

    def _depth(self, req: Request) -> int:
        """Tree depth this round: no deeper than the tokens the request may still emit, or its context."""
        if self.tree is None:
            return 0
        room = min(req.remaining_tokens, self.max_model_len - req.num_tokens)
        # Candidates sit at positions num_tokens .. num_tokens + depth - 1: all inside the draft's context.
        return max(0, min(self.tree.depth, room - 1, self.draft_max_len - req.num_tokens))

    def _draft(self, batch: ScheduledBatch, finished_ids: list[int]) -> list[CandidateTree]:
        vocab = self.vocab_size
        if not self.draft_up:
            return [CandidateTree.empty(vocab) for _ in batch.rounds]
        commits = [self._draft_commits.pop(r.seq_id) for r in batch.rounds if r.seq_id in self._draft_commits]
        msg = DraftStep(commits=commits, finished=finished_ids, prefills=[
            PrefillSeq(c.req.seq_id, self._draft_table(c.req), c.start, c.req.all_token_ids[c.start:c.end])
            for c in batch.prefills])
        drafted = [r for r in batch.rounds if self._depth(r) > 0]
        for r in drafted:
            msg.seqs.append(DraftSeq(r.seq_id, self._draft_table(r), r.num_cached_draft,
                                     r.all_token_ids[r.num_cached_draft:], sampling_spec(r),
                                     list(self.tree.branching[: self._depth(r)])))
        self.executor.submit_draft(msg)
        out = self.executor.wait_draft()
        self.times.draft_s += out.elapsed_s
        trees = {res.seq_id: res.trees[0] for res in out.results}
        return [trees.get(r.seq_id) or CandidateTree.empty(vocab) for r in batch.rounds]

    def _target_step(self, batch: ScheduledBatch, trees: list[CandidateTree], finished_ids: list[int]) -> TargetStep:
        tables = self.scheduler.target_blocks.tables
        msg = TargetStep(finished=finished_ids)
        for c in batch.prefills:
            fresh = c.completes_prefill and not c.req.output_token_ids
            msg.prefills.append(PrefillSeq(c.req.seq_id, tables[c.req.seq_id], c.start,
                                           c.req.all_token_ids[c.start:c.end], sampling_spec(c.req) if fresh else None))
        for r, t in zip(batch.rounds, trees, strict=True):
            msg.seqs.append(VerifySeq(r.seq_id, tables[r.seq_id], r.num_cached_target,
                                      r.all_token_ids[r.num_cached_target:], t.tokens.tolist(), t.parents.tolist(),
                                      sampling_spec(r), None if r.params.greedy else t.draft_probs))
        return msg

    def _commit_prefills(self, batch: ScheduledBatch, first_tokens: dict[int, int]) -> list[Request]:
        finished = []
        for c in batch.prefills:
            c.req.num_cached_target = c.end
            if self.draft_up:
                c.req.num_cached_draft = c.end
            tok = first_tokens.get(c.req.seq_id)
            if tok is not None and self._emit(c.req, [tok]):
                finished.append(c.req)
        return finished

    def _commit_rounds(self, batch: ScheduledBatch, trees: list[CandidateTree], results) -> list[Request]:
        finished = []
        for req, tree, res in zip(batch.rounds, trees, results, strict=True):
            accepted = res.accepted_nodes
            # Committed now: the in-flight tokens and the accepted path (emitted below, so not yet in num_tokens).
            req.num_cached_target = req.num_tokens + len(accepted)
            if self.has_draft and len(tree.tokens) and self.pipeline is None:
                depth = self._depth(req)
                u = req.num_tokens - req.num_cached_draft
                # The deepest level was never forwarded through the draft: it has no draft KV to keep.
                kept = accepted[: depth - 1]
                path = list(range(u)) + [u + j for j in kept]
                self._draft_commits[req.seq_id] = CommitSpec(self._draft_table(req), req.num_cached_draft, path)
                req.num_cached_draft += u + len(kept)
            n_drafted = len(tree.tokens)
            req.stats.record_round(n_drafted, len(accepted), len(res.tokens))
            self.stats.record_round(n_drafted, len(accepted), len(res.tokens), drafted=n_drafted > 0)
            done = self._emit(req, res.tokens)
            if done:
                finished.append(req)
            else:
                self.scheduler.after_commit(req)
        return finished

    def _emit(self, req: Request, tokens: list[int]) -> bool:
        """Append what the round produced, up to a stop; True when the request is finished."""
        checker = self._stop[req.seq_id]
        if req.stats.first_token_time is None:
            req.stats.first_token_time = time.monotonic()
        kept, stopped = checker.truncate(req.output_token_ids, tokens, req.remaining_tokens)
        req.output_token_ids += kept
        reason = None
        if stopped:
            reason = FinishReason.STOP
        elif req.remaining_tokens <= 0 or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        self.scheduler.finish(req, reason)
        self._forget_draft_state(req.seq_id)
        self._finished_ids.append(req.seq_id)
        return True

    def _take_finished(self) -> list[int]:
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _draft_table(self, req: Request) -> list[int]:
        return self.scheduler.draft_blocks.tables[req.seq_id]

    def _output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self._stop[req.seq_id].final_text(req.output_token_ids)
        self._stop.pop(req.seq_id, None)
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), text,
                             req.finish_reason.value if req.finish_reason else None, req.finished, req.stats.as_dict())


