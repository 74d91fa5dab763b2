"""Start-up profiling for the adaptive speculation policy: seed its cost curves before the first user request.

A policy that learns its costs from user traffic alone starts cold: until both curves have points it runs the
configured depth, and then it knows only the sizes it happened to run (one depth at batch 1, say), so every
other depth is an extrapolation and its first choices are guesses. Here a few groups of dummy sequences run
through the ordinary engine loop at forced depths (plain decode, a short chain, the configured tree) and batch
sizes (1, 2, 4, ... up to ``max_num_seqs``: one per log2 bucket, as the curves keep them), greedy and sampled,
within a time budget: each step's measured draft / verify / state times land in the policy's curves exactly as
user steps will. A batch size the profiling leaves out decodes plainly until an exploration has measured a second
size there (``CostModel.knows_batch_size``): with batch sizes in powers of 4, batch 64 on the built-in pair
(budget spent below it) ran 18 plain steps of its first group, and every group's tail through batch 23-45 (never
profiled) decoded plainly; the adaptive policy was 0.93x a chain of 4 at batch 64, 0.98x with every octave's
greedy curves measured (``benchmarks/results/adaptive-2026-12-04d``). What the dummy prompts
teach about acceptance (random tokens accept unlike real text) is dropped afterwards, as are the engine's
statistics; the cost curves stay.

The curves are also kept in a file (``$SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``) keyed by everything
that sets the machine's step costs: the checkpoints (paths, sizes, modification times), the engine's shapes and
placement, torch and this code (its files' sizes and times), the host. An engine started again with the same key
within a week takes them from there instead of profiling (a restarted server serves at once). The live steps
keep them current, and what they learn goes back to the file (``ProfileKeeper``: every minute of steps and at
shutdown), so a restarted engine also keeps the sizes it measured under load and how often its explorations
found them unchanged, instead of paying those explorations again. A file that cannot be read or is not ours is
ignored and rewritten.
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
from typing import TYPE_CHECKING, Any

import torch

from scheduler.acceptance import AcceptanceTracker
from scheduler.adaptive import AdaptivePolicy
from scheduler.cost_model import CostModel, cost_model_from_dict, cost_model_to_dict
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

PROMPT_LEN = 8  # dummy prompt tokens: the decode costs being profiled hardly depend on the context length
MAX_BATCH = 256  # larger batches are priced by extrapolating the curves (their slope is measured by then)
SKIPPED = 2  # steps of a group not learned from: the prefill step and the first round
ROUNDS = 4  # verify rounds per group: the first of each group prefills, the rest are what the curves keep
CACHE_FORMAT = 2  # 2: the draft's curves per batch size
CACHE_MAX_AGE_S = 7 * 24 * 3600  # older profiles are measured again (the machine's load, its updates, drift)
_CODE_DIRS = ("engine", "scheduler", "workers")


def cache_dir() -> Path | None:
    """Where profiles are kept: ``$SPECSERVE_CACHE_DIR`` (empty: nowhere), else ``$XDG_CACHE_HOME/specserve``,
    else ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specserve"


def _files_stat(path: str) -> list[list[Any]]:
    """(name, size, mtime) of a checkpoint's files (a directory's top level, or one file): a rewritten
    checkpoint is another model."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def profile_key(engine: LLMEngine) -> str:
    """A digest of what the step costs depend on (see the module's docstring)."""
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
        "draft": [cfg.speculative.model, _files_stat(cfg.speculative.model)] if cfg.speculative else None,
        "speculative": spec, "dtype": cfg.dtype, "quantization": cfg.quantization, "device": cfg.device,
        "max_model_len": engine.max_model_len, "scheduler": dataclasses.asdict(cfg.scheduler),
        "cache": dataclasses.asdict(cfg.cache), "parallel": parallel, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "host": platform.node(),
        "machine": platform.machine(), "code": code,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_profile(path: Path, policy: AdaptivePolicy) -> bool:
    """The policy's cost curves from a profile file; False (nothing changed) if it is missing, too old, or not
    a profile of ours."""
    try:
        if time.time() - path.stat().st_mtime > CACHE_MAX_AGE_S:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            return False
        greedy, sampled = cost_model_from_dict(data["greedy"]), cost_model_from_dict(data["sampled"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if not greedy.ready:
        return False
    policy.cost, policy.sampled_cost = greedy, sampled
    return True


def save_profile(path: Path, policy: AdaptivePolicy) -> None:
    """Written whole or not at all (a temporary file renamed over it); a cache that cannot be written is only a
    slower next start."""
    data = {"format": CACHE_FORMAT, "greedy": cost_model_to_dict(policy.cost),
            "sampled": cost_model_to_dict(policy.sampled_cost)}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def profile_path(engine: LLMEngine) -> Path | None:
    """The profile file of this engine's setup (None: no cache folder)."""
    folder = cache_dir()
    return folder / f"policy-costs-{profile_key(engine)}.json" if folder is not None else None


def warm_up_policy(engine: LLMEngine, policy: AdaptivePolicy, budget_s: float, cache: bool = True
                   ) -> ProfileKeeper | None:
    """The policy's cost curves: from the profile of this same setup if one is cached, else profiled here
    (``profile``) and cached. Returns what keeps the file current from the live steps (None without a cache)."""
    if budget_s <= 0:  # learn from the first requests: nothing read, nothing written
        return None
    path = profile_path(engine) if cache else None
    if path is None or not load_profile(path, policy):
        steps = profile(engine, policy, budget_s)
        if path is not None and steps and policy.cost.ready:
            save_profile(path, policy)
    return ProfileKeeper(path, policy) if path is not None else None


class ProfileKeeper:
    """Writes the policy's live cost curves back to its profile file, at most every ``every_s`` seconds of steps
    and at shutdown, so a killed engine loses at most that much of what it learned.

    Why: a curve first measured under load (a batch size the start-up profiling did not reach, a speculative size
    at that batch size) costs explorations, and an exploration at saturation stalls the whole batch: at
    concurrency 64 on the larger random pair one took ~3 s against ~0.6 s for a plain step, 3-8 % of a short run.
    A restarted server that kept the curves (and how often each size's re-measurement found it unchanged, which
    spaces those explorations out) does not pay them again."""

    def __init__(self, path: Path, policy: AdaptivePolicy, every_s: float = 60.0) -> None:
        self.path, self.policy, self.every_s = path, policy, every_s
        self._due = time.monotonic() + every_s
        self._seen = self._clocks()

    def _clocks(self) -> tuple[int, int]:
        """Observations so far: nothing new to write while they are unchanged."""
        return self.policy.cost.verify.clock, self.policy.sampled_cost.verify.clock

    def tick(self) -> None:
        """After a step: write if ``every_s`` has passed since the last write and something was learned."""
        if time.monotonic() >= self._due:
            self.save()

    def save(self) -> None:
        self._due = time.monotonic() + self.every_s
        clocks = self._clocks()
        if clocks != self._seen and self.policy.cost.ready:
            try:
                save_profile(self.path, self.policy)
            except RuntimeError:  # a shutdown from another thread raced a step's update: the next write has it
                return
            self._seen = clocks


def profile(engine: LLMEngine, policy: AdaptivePolicy, budget_s: float) -> int:
    """Run dummy groups (forced shape x batch size x regime) until ``budget_s`` is spent; the steps run."""
    if budget_s <= 0 or engine.max_model_len < 4 * PROMPT_LEN:  # no room for dummy sequences: learn as it goes
        return 0
    k_max = policy.base.tree.depth
    tree = policy.base.tree.branching
    shapes = list(dict.fromkeys([(), (1,) * max(1, k_max // 2), tree]))  # plain, a short chain, the configured
    top = min(engine.config.scheduler.max_num_seqs, MAX_BATCH)
    batches = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]  # one per log2 bucket
    rng = random.Random(0)
    deadline = time.perf_counter() + budget_s
    steps = 0
    try:
        # The first calls pay one-off costs (allocator, kernels' first run): one round of the configured shape,
        # then forgotten (a whole group of it was the dearest group of all, a third of the 3 s budget on a slow
        # model at batch 1).
        policy.forced = tree
        steps += _group(engine, rng, 1, 0.0, len(tree), rounds=1)
        policy.cost, policy.sampled_cost = CostModel(), CostModel()
        # Per batch size, plain decode and the short chain of each regime first: two verify sizes and a draft
        # forward are what a batch size's curves need to price any plan (``CostModel.ready``,
        # ``knows_batch_size``), so a budget cut short on a slow model leaves the policy able to plan; then the
        # configured shape, each batch size and regime. Both regimes at a batch size before the next size: with
        # the greedy regime at every size first (5 s on the built-in pair reached the sampled one at batch 1-2
        # only), sampled steps at batch 64 were priced on the greedy curves of that size and the policy ran
        # 0.90x a chain of 5 at T = 0.8, against 0.99x when neither regime had measured batch 64. On the built-in
        # pair both regimes up to batch 64 take ~10 s, the configured shape another ~12.
        temperatures = (0.0, 0.8)  # sampled steps have their own curves
        groups = [(b, s, t) for b in batches for t in temperatures for s in shapes[:2]]
        groups += [(b, s, t) for b in batches for s in shapes[2:] for t in temperatures]
        for b, shape, temperature in groups:
            if time.perf_counter() > deadline:
                return steps
            policy.forced = shape
            steps += _group(engine, rng, b, temperature, len(shape))
    finally:
        policy.forced = None
        policy.observing = True
        policy.acceptance = AcceptanceTracker()  # random prompts: their acceptance is not the users'
        policy._last.clear()
        engine.stats.__init__()
        engine.times.__init__()
    return steps


def _group(engine: LLMEngine, rng: random.Random, batch: int, temperature: float, depth: int,
           rounds: int = ROUNDS) -> int:
    """``batch`` dummy requests: a prefill step and ``rounds`` rounds of ``depth`` (the first ``SKIPPED`` steps
    not learned from), then aborted; the steps run."""
    vocab = engine.vocab_size
    ids = [f"__policy_warmup_{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(1, vocab) for _ in range(PROMPT_LEN)]
        # Room for every round to be fully accepted, so none is cut short by the token limit.
        engine.add_request(rid, prompt, SamplingParams(max_tokens=(rounds + SKIPPED) * (depth + 1),
                                                       temperature=temperature, ignore_eos=True))
    steps = 0
    policy = engine.scheduler.policy
    while engine.has_unfinished and steps <= rounds + SKIPPED:
        # The prefill step and the first round pay one-off costs (the draft's own prefill, new shapes): not kept.
        policy.observing = steps >= SKIPPED
        engine.step()
        steps += 1
    policy.observing = True
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # finishes the aborted ones (no model call)
    return steps
