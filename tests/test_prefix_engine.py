"""Prefix caching through the engine: greedy output is identical with caching on and off, and a poisoned cache
(a hash that names the wrong prefix) is caught by that comparison.

Requests share a system prompt and arrive a few steps apart, so later ones start on the blocks the earlier ones
committed (target and draft); an agent-style request resends a whole conversation (prompt + output). Every
configuration must reproduce the run with caching off token for token, and the cache must have been hit.
"""

from __future__ import annotations

import pytest

from engine.core.config import DEFAULT_MODELS_DIR
from engine.core.llm_engine import LLMEngine
from engine.llm import LLM
from scheduler.prefix_cache import hash_block
from scheduler.sampling_params import SamplingParams
from tests.conftest import marked_slow, run_to_completion, spec
from tests.test_engine_greedy import hf_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SYSTEM = [1] + [(13 * i) % 120 + 3 for i in range(27)]  # 28 tokens: 7 blocks of 4
# Shared whole, in part, not at all (the last one: as long as the others, so a wrong hash would reuse their K/V).
PROMPTS = [SYSTEM + [5, 6], SYSTEM + [7], SYSTEM[:17] + [9, 9, 9], SYSTEM + [5, 6], [1, 40, 41],
           [1] + list(range(60, 89))]


def staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
              every: int = 2) -> list[list[int]]:
    """Add the prompts ``every`` steps apart, then one resending the first conversation; the outputs."""
    outs: dict = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        for _ in range(every):
            outs.update({o.request_id: o for o in engine.step_finished()})
    outs.update(run_to_completion(engine))
    agent = prompts[0] + outs["0"].token_ids + [3]
    engine.add_request("agent", agent, params)
    outs.update(run_to_completion(engine))
    return [outs[str(i)].token_ids for i in range(len(prompts))] + [outs["agent"].token_ids]


def generate(target: str | None, speculative, caching: bool, **kw) -> tuple[list[list[int]], LLMEngine]:
    prompts = kw.pop("prompts", PROMPTS)
    llm = LLM(target, speculative, enable_prefix_caching=caching, **kw)
    return staggered(llm.engine, prompts), llm.engine


CONFIGS = {  # name -> speculative_config builder (the perturbed draft: acceptance is partial)
    "none": lambda m: None,
    "chain3": lambda m: spec(m.perturbed, 3),
    "tree221": lambda m: spec(m.perturbed, None, [2, 2, 1]),
    "pipelined": lambda m: {**spec(m.perturbed, 3), "pipeline": True, "pipeline_switch": False},
    "adaptive-lazy-draft": lambda m: spec(m.perturbed, 3, adaptive=True),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_identical_with_caching_on_and_off(llama, config: str) -> None:
    cfg = CONFIGS[config](llama)
    off, _ = generate(llama.target, cfg, False, block_size=4)
    on, engine = generate(llama.target, cfg, True, block_size=4)
    assert on == off
    assert on[:-1] == hf_greedy(llama.target, PROMPTS, GREEDY.max_tokens)
    stats = engine.scheduler.prefix_stats
    assert stats.hits >= 3 * 24, stats  # the later shared-prompt requests and the agent's resend hit
    if cfg is not None:
        assert stats.draft_hits > 0, stats  # the draft's prefill was cached too
    s = engine.scheduler
    assert s.target_blocks.num_free == s.target_blocks.num_blocks  # cached blocks are free to take


def poisoned(parent: bytes, tokens, extra: tuple = ()) -> bytes:
    """A wrong block hash: it ignores the block's tokens, so blocks at the same place in different prompts
    collide and a request reuses another prefix's K/V."""
    return hash_block(parent, [len(tokens)], extra)


@pytest.mark.parametrize("config", ["none", "chain3"])
def test_a_poisoned_cache_fails_the_identity_test(llama, config: str) -> None:
    """The identity test above has power: with a hash that lets a different prefix be reused, output changes."""
    cfg = CONFIGS[config](llama)
    prompts = [[1] + list(range(50, 70)), [1] + list(range(80, 100))]  # same length, nothing shared but [1]
    off, _ = generate(llama.target, cfg, False, block_size=4, prompts=prompts)
    llm = LLM(llama.target, cfg, block_size=4)
    llm.engine.scheduler.hash_fn = poisoned
    on = staggered(llm.engine, prompts)
    assert llm.engine.scheduler.prefix_stats.hits > 0
    assert on[1] != off[1]  # the second prompt ran on the first one's K/V: the comparison catches it


BUILTIN = {  # the built-in pair (trained draft: high acceptance), fixed depth so rounds really speculate
    "chain4": {"adaptive": False, "num_speculative_tokens": 4},
    "pipelined": {"adaptive": False, "num_speculative_tokens": 4, "pipeline": True, "pipeline_switch": False},
}


@pytest.mark.parametrize("config", marked_slow(sorted(BUILTIN), {"pipelined"}))
def test_builtin_pair_greedy_identical_with_caching_on_and_off(config: str) -> None:
    system = [1] + [(37 * i) % 4000 + 20 for i in range(40)]  # 41 tokens: 2 blocks of 16
    prompts = [system + [100 + i] for i in range(3)] + [system[:20] + [7, 8]]
    results = {}
    for caching in (False, True):
        llm = LLM(None, BUILTIN[config], enable_prefix_caching=caching)
        results[caching] = staggered(llm.engine, prompts)
    assert results[True] == results[False]
    assert llm.engine.scheduler.prefix_stats.hits >= 2 * 32
    assert llm.engine.stats.num_rounds > 0


V4_MODELS = DEFAULT_MODELS_DIR / "v4-target", DEFAULT_MODELS_DIR / "draft"


@pytest.mark.slow
@pytest.mark.skipif(not (V4_MODELS[0] / "config.json").is_file(), reason="built-in V4 target not installed")
def test_v4_target_recomputes_its_prefix() -> None:
    """A DeepSeek-V4 target's compressed state is not in its KV blocks: the engine runs it without prefix caching
    (greedy identical either way), and the test shows why: forced on, a shared prefix corrupts the output."""
    system = [1] + [(37 * i) % 900 + 20 for i in range(40)]
    prompts = [system + [100 + i] for i in range(3)]
    cfg = {"model": str(V4_MODELS[1]), "adaptive": False, "num_speculative_tokens": 3}
    results = {}
    for caching in (False, True):
        llm = LLM(str(V4_MODELS[0]), cfg, enable_prefix_caching=caching)
        results[caching] = staggered(llm.engine, prompts)
    assert not llm.engine.scheduler.target_blocks.enable_caching
    assert results[True] == results[False]
    forced = LLM(str(V4_MODELS[0]), cfg)
    for pool in (forced.engine.scheduler.target_blocks, forced.engine.scheduler.draft_blocks):
        pool.enable_caching = True
    try:
        broken = staggered(forced.engine, prompts)
    except Exception:  # noqa: BLE001 - a worker that refuses the shared prefix is as good a proof as wrong output
        broken = None
    assert broken != results[False]


def test_prometheus_counts_prefix_cache_queries_and_hits(llama) -> None:
    from engine.server.metrics import ServerMetrics, read_engine_stats

    _, engine = generate(llama.target, None, True, block_size=4)
    metrics = ServerMetrics("m")
    metrics.observe_stats(read_engine_stats(engine))
    metrics.observe_stats(read_engine_stats(engine))  # counters advance by differences: no double count
    value = metrics.registry.get_sample_value
    stats = engine.scheduler.prefix_stats
    assert value("specserve:prefix_cache_queries_total", {"model_name": "m"}) == stats.queries > 0
    assert value("specserve:prefix_cache_hits_total", {"model_name": "m"}) == stats.hits > 0


@pytest.mark.parametrize("config", ["none", "tree221"])
def test_memory_pressure_preempts_and_output_is_unchanged(llama, config: str) -> None:
    """A pool too small for every request (cached blocks give way before anyone waits: tests/test_prefix_cache.py):
    requests are preempted, hits still happen, and the output is the output with caching off."""
    cfg = CONFIGS[config](llama)
    off, _ = generate(llama.target, cfg, False, block_size=4, num_kv_tokens=112)
    llm = LLM(llama.target, cfg, block_size=4, num_kv_tokens=112)
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def recording(*a, **kw):
        batch = schedule(*a, **kw)
        preempted.extend(batch.preempted)
        return batch

    llm.engine.scheduler.schedule = recording
    on = staggered(llm.engine, PROMPTS, every=1)
    assert on == off
    assert preempted and llm.engine.scheduler.prefix_stats.hits > 0
    pool = llm.engine.scheduler.target_blocks
    assert pool.num_free == pool.num_blocks and pool.num_cached <= pool.num_blocks


def test_the_flag_turns_caching_off() -> None:
    import argparse

    from engine.core.args import EngineArgs

    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(ap.parse_args([])).to_engine_config().cache.enable_prefix_caching
    args = EngineArgs.from_cli_args(ap.parse_args(["--no-enable-prefix-caching"]))
    assert not args.to_engine_config().cache.enable_prefix_caching


@pytest.mark.slow
def test_a_replaced_draft_forgets_its_cached_prefixes(llama) -> None:
    """The draft process dies: its replacement's cache is empty, so no prefix cached before (or while it was
    down) may count as the draft's; the target's cache is untouched, and the output is as without the fault."""
    import os
    import signal
    import time

    cfg = spec(llama.perturbed, 3)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    reference, _ = generate(llama.target, cfg, True, block_size=4, prompts=prompts)
    with LLM(llama.target, {**cfg, "draft_process": True}, block_size=4) as llm:
        engine, stats = llm.engine, llm.engine.scheduler.prefix_stats
        outs = [llm.generate([prompts[0]], GREEDY)[0].token_ids]
        os.kill(engine.executor.describe()["draft_pid"], signal.SIGKILL)
        engine.add_request("1", prompts[1], GREEDY)
        done: dict = {}
        deadline = time.monotonic() + 120
        while engine.has_unfinished or engine.recovery.degraded:
            assert time.monotonic() < deadline, "the draft was not replaced in time"
            done.update({o.request_id: o.token_ids for o in engine.step_finished()})
        assert engine.recovery.stats.restarts == {"draft": 1} and engine.draft_up
        outs.append(done["1"])
        hits, draft_hits = stats.hits, stats.draft_hits
        outs.append(llm.generate([prompts[2]], GREEDY)[0].token_ids)
        assert stats.hits - hits >= 24  # the target still had the system prompt
        assert stats.draft_hits == draft_hits  # the new draft had none of it: recomputed, not trusted
    assert outs == reference[:3]
