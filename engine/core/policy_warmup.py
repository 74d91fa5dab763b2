"""The speculation policy's engine side: building it from the speculative config, and seeding the adaptive
policy's cost curves before the first user request: start-up profiling, kept in a profile cache keyed by
everything that sets the step costs (docs/adaptive.md, Warm-up).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.drafting.draftless_config import DRAFTLESS_METHODS
from scheduler.adaptive import AdaptivePolicy
from scheduler.adaptive.costs import CostModel
from scheduler.sampling_params import SamplingParams
from scheduler.spec_policy import BatchSizeSchedule, SpecPolicy, TreeShape

if TYPE_CHECKING:
    from engine.core.config import EngineConfig, SpeculativeConfig

SKIPPED = 2  # steps of a group not learned from: the prefill step and the first round (one-off costs)
CACHE_FORMAT = 4  # 4: scheduler/adaptive/costs.py, points without confirmations
_CODE_DIRS = ("engine", "scheduler", "workers")


class LLMEngine(Protocol):
    """What warm-up uses of an engine: its public loop (engine/core/llm_engine.py)."""

    config: EngineConfig
    max_model_len: int
    vocab_size: int

    @property
    def has_unfinished(self) -> bool: ...
    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Any: ...
    def step(self) -> Any: ...
    def abort_request(self, request_id: str) -> bool: ...
    def reset_stats(self) -> None: ...


def build_policy(spec: SpeculativeConfig, tree: TreeShape, max_model_len: int, draft_max_len: int
                 ) -> SpecPolicy | AdaptivePolicy:
    """The configured depth, vLLM's batch-size schedule, or the adaptive policy around the configured tree."""
    base = SpecPolicy(tree, max_model_len, draft_max_len)
    if spec.batch_size_schedule is not None:
        return BatchSizeSchedule(tree, max_model_len, draft_max_len, table=spec.batch_size_schedule)
    if not spec.is_adaptive:
        return base
    policy = AdaptivePolicy(base)
    if spec.method in DRAFTLESS_METHODS and spec.fallback is None:
        # proposals cost the controller, not a draft forward (never measured); a fallback's drafts are a model's
        # and layer_skip's the target's own passes, both measured like a draft's
        for costs in (policy.costs, policy.sampled_costs):
            for tokens in (1, 2):
                costs.draft.observe(tokens, 0.0)
                costs.draft_call.observe(tokens, 0.0)
    return policy


def cache_dir() -> Path | None:
    """``$SPECSERVE_CACHE_DIR`` (empty: nowhere), else ``$XDG_CACHE_HOME/specserve``, else ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specserve"


def _files_stat(path: str) -> list[list[Any]]:
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def profile_key(engine: LLMEngine) -> str:
    """A digest of what the step costs depend on."""
    cfg = engine.config
    spec = dataclasses.asdict(cfg.speculative) if cfg.speculative is not None else None
    if spec is not None:  # how long to profile and whether to cache it do not change the costs
        spec.pop("adaptive_warmup_s", None)
        spec.pop("adaptive_cost_cache", None)
    parallel = dataclasses.asdict(cfg.parallel)
    for name in ("placement_timeout_s", "max_worker_restarts", "worker_restart_window_s"):
        parallel.pop(name, None)
    root = Path(__file__).resolve().parents[2]
    code = [[str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
            for d in _CODE_DIRS for f in sorted((root / d).rglob("*.py"))]
    material = {
        "format": CACHE_FORMAT, "target": [cfg.target, _files_stat(cfg.target)],
        "draft": ([cfg.speculative.model, _files_stat(cfg.speculative.model)]
                  if cfg.speculative is not None and cfg.speculative.model else None),  # draftless: none
        "speculative": spec, "dtype": cfg.dtype, "quantization": cfg.quantization, "device": cfg.device,
        "max_model_len": engine.max_model_len, "scheduler": dataclasses.asdict(cfg.scheduler),
        "cache": dataclasses.asdict(cfg.cache), "parallel": parallel, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "host": platform.node(),
        "machine": platform.machine(), "code": code,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def profile_path(engine: LLMEngine) -> Path | None:
    folder = cache_dir()
    return folder / f"policy-costs-{profile_key(engine)}.json" if folder is not None else None


def load_profile(path: Path, policy: AdaptivePolicy) -> bool:
    """The policy's curves from a profile file; False (nothing changed) if missing, too old, or not ours."""
    try:
        if time.time() - path.stat().st_mtime > policy.config.profile_max_age_s:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            return False
        greedy = CostModel.from_dict(data["greedy"], policy.config)
        sampled = CostModel.from_dict(data["sampled"], policy.config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if not greedy.ready:
        return False
    policy.costs, policy.sampled_costs = greedy, sampled
    return True


def save_profile(path: Path, policy: AdaptivePolicy) -> None:
    """Written whole or not at all; a cache that cannot be written is only a slower next start."""
    data = {"format": CACHE_FORMAT, "greedy": policy.costs.to_dict(), "sampled": policy.sampled_costs.to_dict()}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def warm_up_policy(engine: LLMEngine, policy: AdaptivePolicy, budget_s: float, cache: bool = True) -> None:
    """The curves from the profile of this setup if cached, else profiled here and cached. ``budget_s`` <= 0:
    learn from the first requests."""
    if budget_s <= 0:
        return
    path = profile_path(engine) if cache else None
    if path is None or not load_profile(path, policy):
        steps = profile(engine, policy, budget_s)
        if path is not None and steps and policy.costs.ready:
            save_profile(path, policy)


def profile(engine: LLMEngine, policy: AdaptivePolicy, budget_s: float) -> int:
    """Run dummy groups (batch size x regime x forced shape) until ``budget_s`` is spent; the steps run. Per
    batch size both regimes' plain decode and short chain first (what a batch size needs to price any plan),
    then the configured shape."""
    if budget_s <= 0 or engine.max_model_len < 4 * policy.config.profile_prompt_len:
        return 0
    tree = policy.base.tree.branching
    shapes = list(dict.fromkeys([(), (1,) * max(1, len(tree) // 2), tree]))
    top = min(engine.config.scheduler.max_num_seqs, policy.config.profile_max_batch)
    batches = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
    rng = random.Random(0)
    deadline = time.perf_counter() + budget_s
    steps = 0
    try:
        # The first calls pay one-off costs (allocator, kernels' first run): one round, then forgotten.
        policy.forced = tree
        steps += _group(engine, policy, rng, 1, 0.0, len(tree), rounds=1)
        policy.costs, policy.sampled_costs = CostModel(policy.config), CostModel(policy.config)
        groups = [(b, s, t) for b in batches for t in (0.0, 0.8) for s in shapes[:2]]
        groups += [(b, s, t) for b in batches for s in shapes[2:] for t in (0.0, 0.8)]
        for b, shape, temperature in groups:
            if time.perf_counter() > deadline:
                break
            policy.forced = shape
            steps += _group(engine, policy, rng, b, temperature, len(shape))
    finally:
        policy.forced = None
        policy.observing = True
        policy.reset_acceptance()  # random prompts: their acceptance is not the users'
        engine.reset_stats()
    return steps


def _group(engine: LLMEngine, policy: AdaptivePolicy, rng: random.Random, batch: int, temperature: float,
           depth: int, rounds: int | None = None) -> int:
    """``batch`` dummy requests: a prefill step and ``rounds`` rounds of ``depth``, then aborted."""
    ids = [f"__policy_warmup_{i}" for i in range(batch)]
    rounds = policy.config.profile_rounds if rounds is None else rounds
    for rid in ids:
        prompt = [rng.randrange(1, engine.vocab_size) for _ in range(policy.config.profile_prompt_len)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=(rounds + SKIPPED) * (depth + 1),
                                                       temperature=temperature, ignore_eos=True))
    steps = 0
    while engine.has_unfinished and steps <= rounds + SKIPPED:
        policy.observing = steps >= SKIPPED
        engine.step()
        steps += 1
    policy.observing = True
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # finishes the aborted ones (no model call)
    return steps
