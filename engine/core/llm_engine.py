"""The controller loop: schedule -> draft -> verify -> commit -> emit, with continuous batching.

Requests join between steps and leave when they finish; the scheduler decides who runs, how deep each tree
goes, reserves their KV and owns the cache counters. A drafter (engine/drafting/drafter.py: none, sequential or
pipelined) proposes the trees; the target verifies them and commits its own KV. The draft and target workers
are called through typed messages, so the Ray executor can move them into actors without touching this loop;
the controller handles ints only (the draft's laws go to the verifier directly).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import secrets
import time

from engine.core.config import EngineConfig
from engine.core.draft_setup import draft_setup
from engine.core.intake import prompt_token_ids, resume
from engine.core.metrics import SpecDecodingStats, StepTimes, reset
from engine.core.outputs import RequestDelta, RequestOutput
from engine.core.policy_warmup import build_policy, warm_up_policy
from engine.core.step_extras import StepExtras
from engine.core.stopping import StopChecker
from engine.drafting.build import build_drafter
from engine.drafting.drafter import Drafter, NoDrafter, sampling_spec
from engine.drafting.pipelined_drafter import PipelinedDrafter
from engine.execution.executor import make_executor
from engine.execution.faults import WorkerDiedError
from engine.execution.recovery import Recovery
from engine.execution.role import Role
from scheduler.adaptive import AdaptivePolicy
from scheduler.block_manager import BlockManager
from scheduler.prefix_cache import namespace
from scheduler.request import FinishReason, Request
from scheduler.reset import draft_refilled, requeue_all
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch, Scheduler
from workers.loader import load_tokenizer
from workers.messages import DraftStep, DraftTree, PrefillSeq, TargetStep, TargetStepOutput, VerifySeq
from workers.model_config import ModelConfig
from workers.worker_config import WorkerConfig

_MAX_AUTO_KV_TOKENS = 1 << 17
_HELD_IDLE_S = 0.02  # a step with nothing to run (requests held for the draft) pauses this long


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
        draft = draft_setup(config, tcfg)
        dspec, dcfg, eagle = draft.spec, draft.model_config, draft.eagle  # dspec: what the draft worker runs
        self.tree = spec.tree_shape if spec is not None else None
        num_nodes = self.tree.num_nodes if self.tree is not None else 0
        bs = config.cache.block_size
        kv_tokens = config.cache.num_kv_tokens or min(
            config.scheduler.max_num_seqs * (self.max_model_len + num_nodes), _MAX_AUTO_KV_TOKENS)
        num_blocks = -(-kv_tokens // bs)
        draft_cfg = draft.worker_config(config, tcfg, num_blocks)
        self.draft_max_len = draft.max_len(self.max_model_len) if spec is not None else 0
        parallel = config.parallel
        if dspec is not None and dspec.draft_tensor_parallel_size != parallel.draft_tensor_parallel_size:
            parallel = dataclasses.replace(parallel, draft_tensor_parallel_size=dspec.draft_tensor_parallel_size)
        # Refuse a size that does not divide the heads before any worker is placed or loads weights.
        tcfg.check_tp(parallel.tensor_parallel_size)
        if dcfg is not None:
            dcfg.check_tp(parallel.draft_tensor_parallel_size)
        self.executor = make_executor(parallel,
                                      WorkerConfig(config.target, num_blocks, bs, config.dtype, config.device,
                                                   **draft.target_options, quantization=config.quantization,
                                                   model_config=tcfg.to_dict()),
                                      draft_cfg, **(dspec.process_options if dspec is not None else {}))
        self.vocab_size = tcfg.vocab_size
        self.eos_token_ids = set(tcfg.eos_token_ids)
        policy = build_policy(spec, self.tree, self.max_model_len, self.draft_max_len) if spec is not None else None
        # no caching: a V4 state lives outside the blocks; an EAGLE head needs the features a cached prefix skips
        v4 = "deepseek_v4" in (tcfg.model_type, dcfg and dcfg.model_type)
        pool = functools.partial(BlockManager, num_blocks, bs, config.cache.enable_prefix_caching and not (v4 or eagle))
        self.scheduler = Scheduler(config.scheduler, pool(namespace(config.target, config.quantization, config.dtype)),
                                   pool(namespace(dspec.model, dspec.quantization, config.dtype)) if dspec else None,
                                   num_nodes, draft_scratch_nodes=spec.draft_scratch_nodes if spec is not None else 0,
                                   policy=policy, lazy_draft_prefill=eagle or (isinstance(policy, AdaptivePolicy)
                                                                                and not spec.pipeline))
        self.stats = SpecDecodingStats()
        self.times = StepTimes()
        self.pipeline: PipelinedDrafter | None = None  # its .stats: pre-draft hits and hidden draft time
        self.drafter: Drafter = self._new_drafter()
        self.draft_up = spec is not None  # False while a dead draft is being replaced: no speculation then
        self._seq_ids = itertools.count()
        self._stop: dict[int, StopChecker] = {}  # seq_id -> stop checks and detokenizer
        self._requests: dict[str, Request] = {}  # unfinished requests by the user's id (for abort)
        self._aborts: dict[str, Request] = {}  # to finish at the start of the next step
        self._emitted: dict[int, tuple[Request, list[int]]] = {}  # this step: seq_id -> tokens appended
        self._finished_outputs: list[RequestOutput] = []  # this step's finished requests, whole
        self.extras = StepExtras(self.tokenizer, tcfg.vocab_size)  # logprobs and grammar masks (step_extras.py)
        self._finished_ids: list[int] = []  # finished since the last step: the workers drop their state
        self._requeued_ids: list[int] = []  # re-queued after a target restart: the draft drops their state
        # Ray workers and a draft process can be replaced when they die; in-process ones die with us.
        self.recovery = (Recovery(self, parallel.max_worker_restarts, parallel.worker_restart_window_s)
                         if hasattr(self.executor, "begin_restart") else None)
        self._warmed = False

    @classmethod
    def create(cls, config: EngineConfig) -> LLMEngine:
        """A built and warmed engine: what the LLM API, the CLI and the server run."""
        engine = cls(config)
        try:
            engine.warm_up()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def warm_up(self) -> None:
        """Seed the adaptive policy's cost curves (profile cache, else start-up profiling) before user requests;
        nothing for other policies. Call once, on a built engine with no requests."""
        policy, spec = self.scheduler.policy, self.config.speculative
        if isinstance(policy, AdaptivePolicy) and not self._warmed:
            self._warmed = True
            warm_up_policy(self, policy, spec.adaptive_warmup_s, cache=spec.adaptive_cost_cache)

    def reset_stats(self) -> None:
        """Start the engine's statistics and step times over (e.g. after warm-up or a benchmark's first pass)."""
        reset(self.stats)
        reset(self.times)
        reset(self.scheduler.prefix_stats)  # the warm-up's lookups are not a user's
        if self.pipeline is not None:
            reset(self.pipeline.stats)

    def _new_drafter(self) -> Drafter:
        drafter, self._draft_calls, self.pipeline = build_drafter(
            self.config.speculative, self.executor, self.scheduler, self.stats, self.times, self.tree,
            self.draft_max_len)
        return drafter

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, output_token_ids: list[int] | None = None) -> Request:
        """Validate and queue; raises ValueError naming the field and the limit.

        ``priority``: lower is admitted first (and preempted last); batch jobs use 1, online requests 0.
        ``output_token_ids``: resume a request an earlier engine began (the server restarting a failed engine):
        these tokens count as produced and streamed; generation continues after them up to ``max_tokens``.
        """
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        # Again here, not only at construction: a field set afterwards must not reach (and fail) a worker step.
        self.extras.check(params)  # ranges, and the grammar compiles
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens, the model's context is {self.max_model_len} "
                             "(prompt + at least one generated token must fit)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        req = Request(next(self._seq_ids), request_id, token_ids, params, priority=priority, tenant=self.config.tenant)
        # Unseeded requests get a private random seed: every tensor-parallel rank then draws the same
        # candidates and uniforms without exchanging them, and no request's stream depends on another's.
        req.seed = params.seed if params.seed is not None else secrets.randbits(63)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        checker = StopChecker(stop_ids, params.stop, self.tokenizer)  # may refuse: before anything is queued
        if output_token_ids:
            resume(req, checker, output_token_ids, self.vocab_size, self.max_model_len)
        self.scheduler.add(req)
        self._stop[req.seq_id] = checker
        self._requests[request_id] = req
        return req

    def withdraw_queued(self, req: Request) -> None:
        """Take back a request that ``add_request`` queued and no step has scheduled yet (no delta for it)."""
        self.scheduler.waiting.remove(req)
        self._stop.pop(req.seq_id, None)
        self._requests.pop(req.request_id, None)
        self._aborts.pop(req.request_id, None)

    def abort_request(self, request_id: str) -> bool:
        """Finish a queued or running request with reason "abort" at the start of the next step, which frees
        its KV and returns its last delta. False when no unfinished request has this id. Like every engine
        call, from the thread that steps the engine."""
        req = self._requests.get(str(request_id))
        if req is None:
            return False
        self._aborts[req.request_id] = req
        return True

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

    @property
    def is_alive(self) -> bool:
        """False once a step failed (every later call raises EngineDeadError)."""
        return self._dead is None

    def step(self) -> list[RequestDelta]:
        """One round for every scheduled request; a delta for each request that got tokens or finished
        (aborted ones included)."""
        self._check_alive()
        self._finished_outputs = []
        try:
            self._apply_aborts()
            if self.recovery is not None:
                self.recovery.poll()
            if self.scheduler.has_unfinished:
                try:
                    self._step()
                except WorkerDiedError as e:
                    if self.recovery is None:
                        raise
                    self.recovery.recover(e)  # the step is abandoned; its requests go on from what they had
            return self.extras.attach(self._take_deltas(), self._finished_outputs)
        except BaseException as e:
            self._dead = e
            raise

    # ------------------------------------------------------------------------------------- worker recovery
    def lose_worker_state(self, role: Role) -> None:
        """``role``'s workers were replaced and their caches are empty: start over from the requests' tokens."""
        if role == Role.TARGET:
            self._requeued_ids += [r.seq_id for r in requeue_all(self.scheduler)]
            if self.draft_up:
                self.drafter = self._new_drafter()  # nothing pre-drafted or pending survives
        else:
            self.drafter = NoDrafter()
            self.draft_up = False

    def resume_draft(self) -> None:
        """A replaced draft is up: fill its cache with every running request's committed tokens, speculate again."""
        if self.config.speculative.is_eagle:  # a head's features died with it: the target recomputes and resends them
            requeue_all(self.scheduler)
        tables = self.scheduler.draft_blocks.tables
        prefills = [PrefillSeq(r.seq_id, tables[r.seq_id], 0, r.all_token_ids[: r.num_cached_target])
                    for r in self.scheduler.running if r.num_cached_target > 0]
        if prefills:
            self.executor.submit_draft(DraftStep(prefills=prefills))
            self.executor.wait_draft()
        draft_refilled(self.scheduler)
        self._requeued_ids.clear()  # the new draft never saw them
        self.drafter = self._new_drafter()
        self.draft_up = True

    def _needs_draft(self, req: Request) -> bool:
        """Held while the draft is down: a seeded sampled request's tokens depend on the draft's proposals (the
        verifier's draws are keyed by seed and position, but what they accept is the draft's tree), so only the
        replaced draft, drawing from the same (seed, position) streams, continues them as without the fault.
        Greedy and unseeded requests decode without speculation meanwhile."""
        return req.params.seed is not None and not req.params.greedy

    def step_finished(self) -> list[RequestOutput]:
        """One step; the requests that finished in it, whole (for callers that do not stream)."""
        self.step()
        return self._finished_outputs

    def _step(self) -> None:
        policy = self.scheduler.policy
        timed = policy is not None and policy.measures_costs  # only the adaptive policy learns step times
        before = dataclasses.replace(self.times) if timed else None
        clock = self.times.clock()
        holding = self.config.speculative is not None and not self.draft_up
        batch = self.scheduler.schedule(self._needs_draft) if holding else self.scheduler.schedule()  # schedule
        finished_ids = self._take_finished()
        clock.lap("schedule_s")
        if batch.empty and holding:  # every request that could run waits for the draft: no worker call
            self._finished_ids = finished_ids + self._finished_ids  # they reach the workers with the next call
            self._requeued_ids += [r.seq_id for r in batch.preempted]
            time.sleep(_HELD_IDLE_S)  # the replacement draft is loading: leave it the CPU
            return
        if timed:
            self._draft_calls.forward_s = []
        gone, self._requeued_ids = finished_ids + [r.seq_id for r in batch.preempted] + self._requeued_ids, []
        trees = self.drafter.propose(batch, gone)  # draft
        clock.lap("draft_wall_s")
        self.executor.submit_target(self.extras.ask(self._target_step(batch, trees, finished_ids), batch))
        self.drafter.overlap(batch, trees)  # pipelined: the draft works on round r+1 meanwhile
        out = self.extras.took(self.executor.wait_target(), batch)  # verify's outcome
        clock.lap("verify_wall_s", verify_s=out.elapsed_s)
        num_cached_draft = self.drafter.commit(batch, trees, out)  # commit: the draft's side, then the outcome
        clock.lap("collect_s")
        self.scheduler.update_from_output(batch, out.results, [t.num_nodes for t in trees], num_cached_draft,
                                          self.stats)
        self._emit_step(batch, out)  # emit
        clock.lap("commit_s")
        if timed:  # the cost model learns the step the policy planned
            forward_s = None if self.pipeline is not None else list(self._draft_calls.forward_s)
            policy.observe_step(batch, self.times.timing_since(before, bool(batch.prefills), forward_s))

    def _target_step(self, batch: ScheduledBatch, trees: list[DraftTree], finished_ids: list[int]) -> TargetStep:
        tables = self.scheduler.target_blocks.tables
        msg = TargetStep(finished=finished_ids)
        for c in batch.prefills:
            fresh = c.completes_prefill and not c.req.output_token_ids
            msg.prefills.append(PrefillSeq(c.req.seq_id, tables[c.req.seq_id], c.start,
                                           c.req.all_token_ids[c.start:c.end], sampling_spec(c.req) if fresh else None))
        for r, t in zip(batch.rounds, trees, strict=True):
            msg.seqs.append(VerifySeq(r.seq_id, tables[r.seq_id], r.num_cached_target,
                                      r.all_token_ids[r.num_cached_target:], t.tokens, t.parents, sampling_spec(r),
                                      -1 if r.params.greedy else t.tree_id))
        return msg

    def _emit_step(self, batch: ScheduledBatch, out: TargetStepOutput) -> None:
        """Every token the step produced, through ``_emit``."""
        for c in batch.prefills:
            tok = out.first_tokens.get(c.req.seq_id)
            if tok is not None:
                self._emit(c.req, [tok])
        for req, res in zip(batch.rounds, out.results, strict=True):
            self._emit(req, res.tokens)

    def _emit(self, req: Request, tokens: list[int]) -> bool:
        """Append what the round produced, up to a stop; True when the request is finished. The one place where
        tokens join a request and a finished request is finalised: the step's deltas are recorded here (and in
        ``_apply_aborts``)."""
        checker = self._stop[req.seq_id]
        if req.stats.first_token_time is None:
            req.stats.first_token_time = time.monotonic()
        kept, stopped = checker.truncate(tokens, req.remaining_tokens)
        req.output_token_ids += kept
        self._emitted.setdefault(req.seq_id, (req, []))[1].extend(kept)
        reason = None
        if stopped:
            reason = FinishReason.STOP
        elif req.remaining_tokens <= 0 or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        self._finish(req, reason)
        return True

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Free its KV; the workers drop its state with the next step's messages."""
        self.scheduler.finish(req, reason)
        req.stats.finish_time = time.monotonic()
        self._finished_ids.append(req.seq_id)
        self._emitted.setdefault(req.seq_id, (req, []))

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, {}
        for req in aborts.values():
            if not req.finished:
                self._finish(req, FinishReason.ABORT)

    def _take_deltas(self) -> list[RequestDelta]:
        """This step's deltas, in the order requests got tokens; finished requests leave the engine here."""
        emitted, self._emitted = self._emitted, {}
        deltas = []
        for req, new in emitted.values():
            checker = self._stop[req.seq_id]
            deltas.append(RequestDelta(
                req.request_id, new, checker.take_text(req.finished), req.finished,
                req.finish_reason.value if req.finished and req.finish_reason else None,
                len(req.prompt_token_ids), len(req.output_token_ids),
                req.stats.as_dict() if req.finished else None))
            if req.finished:
                self._finished_outputs.append(self._output(req))
                del self._stop[req.seq_id]
                self._requests.pop(req.request_id, None)
        return deltas

    def _take_finished(self) -> list[int]:
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                             self._stop[req.seq_id].text, req.finish_reason.value if req.finish_reason else None,
                             req.finished, req.stats.as_dict())
