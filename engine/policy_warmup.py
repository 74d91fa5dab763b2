"""Start-up profiling for the adaptive speculation policy: seed its cost curves before the first user request.

A policy that learns its costs from user traffic alone starts cold: until both curves have points it runs the
configured depth, and then it knows only the sizes it happened to run (one depth at batch 1, say), so every
other depth is an extrapolation and its first choices are guesses. Here a few groups of dummy sequences run
through the ordinary engine loop at forced depths (plain decode, a short chain, the configured tree) and batch
sizes (1, 4, 16, ... up to ``max_num_seqs``), greedy and sampled, within a time budget: each step's measured
draft / verify / state times land in the policy's curves exactly as user steps will. What the dummy prompts
teach about acceptance (random tokens accept unlike real text) is dropped afterwards, as are the engine's
statistics; the cost curves stay.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from scheduler.acceptance import AcceptanceTracker
from scheduler.adaptive import AdaptivePolicy
from scheduler.cost_model import CostModel
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

PROMPT_LEN = 8  # dummy prompt tokens: the decode costs being profiled hardly depend on the context length
MAX_BATCH = 256  # larger batches are priced by extrapolating the curves (their slope is measured by then)
SKIPPED = 2  # steps of a group not learned from: the prefill step and the first round
ROUNDS = 4  # verify rounds per group: the first of each group prefills, the rest are what the curves keep


def warm_up_policy(engine: LLMEngine, policy: AdaptivePolicy, budget_s: float) -> int:
    """Run dummy groups (forced shape x batch size x regime) until ``budget_s`` is spent; the steps run."""
    if budget_s <= 0 or engine.max_model_len < 4 * PROMPT_LEN:  # no room for dummy sequences: learn as it goes
        return 0
    k_max = policy.base.tree.depth
    tree = policy.base.tree.branching
    shapes = list(dict.fromkeys([(), (1,) * max(1, k_max // 2), tree]))  # plain, a short chain, the configured
    batches = [1]
    top = min(engine.config.scheduler.max_num_seqs, MAX_BATCH)
    while batches[-1] * 4 <= top:
        batches.append(batches[-1] * 4)
    if batches[-1] != top:
        batches.append(top)
    rng = random.Random(0)
    deadline = time.perf_counter() + budget_s
    steps = 0
    try:
        # The first calls pay one-off costs (allocator, kernels' first run): run one group, then forget it.
        policy.forced = tree
        steps += _group(engine, rng, 1, 0.0, len(tree))
        policy.cost, policy.sampled_cost = CostModel(), CostModel()
        for b in batches:  # small batches first: what a budget cut leaves out is the rarer case
            for shape in shapes:
                for temperature in (0.0, 0.8):  # sampled steps have their own curves
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


def _group(engine: LLMEngine, rng: random.Random, batch: int, temperature: float, depth: int) -> int:
    """``batch`` dummy requests: a prefill step and ``ROUNDS`` rounds of ``depth``, then aborted; the steps run."""
    vocab = engine.vocab_size
    ids = [f"__policy_warmup_{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(1, vocab) for _ in range(PROMPT_LEN)]
        # Room for every round to be fully accepted, so none is cut short by the token limit.
        engine.add_request(rid, prompt, SamplingParams(max_tokens=(ROUNDS + SKIPPED) * (depth + 1),
                                                       temperature=temperature, ignore_eos=True))
    steps = 0
    policy = engine.scheduler.policy
    while engine.has_unfinished and steps <= ROUNDS + SKIPPED:
        # The prefill step and the first round pay one-off costs (the draft's own prefill, new shapes): not kept.
        policy.observing = steps >= SKIPPED
        engine.step()
        steps += 1
    policy.observing = True
    for rid in ids:
        engine.abort_request(rid)
    engine.step()  # finishes the aborted ones (no model call)
    return steps
