"""The committed KV of every sequence is exactly what a fresh prefill of its committed tokens gives.

Sampling at temperature 1 with a draft that partly agrees with the target makes every round accept a random
number of candidates down a random branch; after each commit, positions [0, num_cached) of both caches (read
through the request's block table) must equal the K/V of a dense causal forward over those tokens. Once every
request finished, no KV block may be left allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine.core.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import SchedulerConfig
from tests.conftest import spec, workers
from workers.attention import DenseCausalContext

TOL = 1e-5
PROMPTS = [[1, 9], [1] + list(range(30, 41)), [1, 5, 6, 7, 8, 100, 101], [1] + [(11 * i) % 120 + 3 for i in range(22)],
           [1, 64]]


@dataclass
class RecordingContext(DenseCausalContext):
    """Dense causal attention that keeps every layer's K/V (after RoPE: what the paged cache stores)."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv[layer] = (k.clone(), v.clone())
        return super().attend(layer, q, k, v)


@torch.inference_mode()
def fresh_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ctx = RecordingContext()
    model(torch.tensor(tokens), torch.arange(len(tokens)), ctx)
    return [ctx.kv[i] for i in range(len(ctx.kv))]


def cached_kv(runner, table: list[int], n: int) -> torch.Tensor:
    bs = runner.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.long)
    return runner.cache.kv[:, :, slots]  # [2, layers, n, Hkv, D]


def check_cache(worker, tables: dict[int, list[int]], requests, which: str) -> int:
    """Compare each request's committed KV with a fresh prefill; returns how many positions were checked."""
    checked = 0
    for req in requests:
        n = req.num_cached_target if which == "target" else req.num_cached_draft
        if n == 0:
            continue
        got = cached_kv(worker.runner, tables[req.seq_id], n)
        want = fresh_kv(worker.model, req.all_token_ids[:n])
        for layer, (k, v) in enumerate(want):
            err_k = (got[0, layer].float() - k.float()).abs().max().item()
            err_v = (got[1, layer].float() - v.float()).abs().max().item()
            assert err_k < TOL and err_v < TOL, (
                f"{which} KV of request {req.request_id} (layer {layer}, {n} committed tokens) differs from a "
                f"fresh prefill: max |dK| = {err_k:.2e}, |dV| = {err_v:.2e}")
        checked += n
    return checked


@pytest.mark.parametrize("case", ["tree-chunked", "chain-preempting", "narrow-trees", "tree-pipelined",
                                  "tree-pipeline-switching"])
def test_committed_kv_equals_fresh_prefill(llama, case: str) -> None:
    if case == "tree-chunked":
        speculative = spec(llama.perturbed, None, [2, 2, 1])
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12)
        cache = CacheConfig(block_size=4)
    elif case == "chain-preempting":
        speculative = spec(llama.perturbed, 4)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
        cache = CacheConfig(block_size=4, num_kv_tokens=96)
    elif case.startswith("tree-pipeline"):
        # The draft keeps the KV of the longest predicted prefix that came true: its commits follow the
        # pre-draft's scratch layout (in-flight chain, prediction nodes), not a verified tree's. Switching: steps
        # forced pipelined and sequential in turn, so commits follow both layouts and the hand-overs between them.
        speculative = {**spec(llama.perturbed, None, [2, 2, 1]), "pipeline": True, "pipeline_switch": False}
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12)
        cache = CacheConfig(block_size=4)
    else:
        # Without replacement under top-k / top-p, a node often has fewer children than the shape allows: the
        # trees come out irregular, and so do the scratch layouts the commits must follow.
        speculative = spec(llama.perturbed, None, [3, 2, 2], sampling="without_replacement")
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
        cache = CacheConfig(block_size=2)
    narrow = [{"top_k": 2}, {"top_p": 0.6}, {"top_k": 1}, {}, {"min_p": 0.3}]
    engine = LLMEngine(EngineConfig(target=llama.target, speculative=SpeculativeConfig.parse(speculative),
                                    scheduler=sched, cache=cache))
    if case == "tree-pipeline-switching":
        engine.pipeline.switch.force = lambda i: i % 6 in (0, 1, 4)  # P P S S P S: runs of 1 and 2
    target, draft = workers(engine)
    sched_ = engine.scheduler
    counts = {"target": 0, "draft": 0, "preempted": 0}

    # The draft applies last round's commits at the start of its next step: check its cache right then.
    real_commit = draft.runner.commit

    def commit_then_check(commits):
        real_commit(commits)
        counts["draft"] += check_cache(draft, sched_.draft_blocks.tables, sched_.running, "draft")

    draft.runner.commit = commit_then_check
    real_preempt = sched_._preempt

    def counting_preempt(req):
        counts["preempted"] += 1
        real_preempt(req)

    sched_._preempt = counting_preempt

    for i, p in enumerate(PROMPTS):
        extra = narrow[i] if case == "narrow-trees" else {}
        engine.add_request(str(i), p, SamplingParams(max_tokens=36, temperature=1.0, seed=100 + i, ignore_eos=True,
                                                     **extra))
    outs = {}
    while engine.has_unfinished:
        batch_outs = engine.step_finished()
        outs.update({o.request_id: o for o in batch_outs})
        counts["target"] += check_cache(target, sched_.target_blocks.tables, sched_.running, "target")
    assert len(outs) == len(PROMPTS) and all(len(o.token_ids) == 36 for o in outs.values())
    stats = engine.stats
    # Random acceptance: some rounds accept nothing, some accept part of the path, some all of it.
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    assert 1 < stats.mean_acceptance_length < speculative["num_speculative_tokens"] + 1, stats.as_dict()
    assert counts["target"] > 500 and counts["draft"] > 500, counts
    if case == "narrow-trees":  # top_k=1: one child per node whatever the shape asks, so chains of <= 3
        assert outs["2"].metrics["drafted_tokens"] <= 3 * outs["2"].metrics["rounds"], outs["2"].metrics
        assert outs["3"].metrics["drafted_tokens"] > 3 * outs["3"].metrics["rounds"], outs["3"].metrics
    if case == "chain-preempting":
        assert counts["preempted"] > 0, "the pool was meant to force preemption"
    assert sched_.target_blocks.num_free == sched_.target_blocks.num_blocks
    assert sched_.draft_blocks.num_free == sched_.draft_blocks.num_blocks
    assert not sched_.target_blocks.tables and not sched_.draft_blocks.tables
