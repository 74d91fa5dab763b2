"""The K/V a request reads through a cached prefix is exactly a fresh prefill of its tokens, in both caches.

Sampled requests sharing a system prompt arrive a few steps apart; after every step the target's committed KV
of every running request (read through its block table, cached blocks included) must equal a dense forward of
its committed tokens, and the draft's likewise right after the draft applied its commits (the method of
tests/test_cache_bookkeeping.py).
"""

from __future__ import annotations

import pytest

from engine.core.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import SchedulerConfig
from tests.conftest import spec, workers
from tests.test_cache_bookkeeping import check_cache

SYSTEM = [1] + [(13 * i) % 120 + 3 for i in range(27)]
PROMPTS = [SYSTEM + [5, 6], SYSTEM + [7], SYSTEM[:17] + [9, 9, 9], SYSTEM + [5, 6]]


@pytest.mark.parametrize("case", ["chain", "tree-pipelined"])
def test_cached_prefixes_hold_a_fresh_prefill_s_kv(llama, case: str) -> None:
    speculative = spec(llama.perturbed, 3) if case == "chain" else {
        **spec(llama.perturbed, None, [2, 2, 1]), "pipeline": True, "pipeline_switch": False}
    engine = LLMEngine(EngineConfig(target=llama.target, speculative=SpeculativeConfig.parse(speculative),
                                    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                                    cache=CacheConfig(block_size=4)))
    target, draft = workers(engine)
    sched = engine.scheduler
    counts = {"target": 0, "draft": 0}
    real_commit = draft.runner.commit

    def commit_then_check(commits):
        real_commit(commits)
        counts["draft"] += check_cache(draft, sched.draft_blocks.tables, sched.running, "draft")

    draft.runner.commit = commit_then_check
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished:
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True))
        for o in engine.step_finished():
            if o.request_id == "0":  # an agent resends the conversation: the target has more of it than the draft
                pending.append((9, PROMPTS[0] + o.token_ids + [3]))
        steps += 1
        assert steps < 2000
        counts["target"] += check_cache(target, sched.target_blocks.tables, sched.running, "target")
    stats = sched.prefix_stats
    assert stats.hits >= 2 * 24 + 40 and stats.draft_hits >= 2 * 24, stats
    assert stats.hits > stats.draft_hits  # the agent's resend: output blocks are the target's only
    assert counts["target"] > 300 and counts["draft"] > 300, counts
