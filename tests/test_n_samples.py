"""n > 1: n independent samples of one prompt, each with its own seed stream, sharing the prompt's KV blocks
through prefix caching (copies wait for the first copy's prefill to be cached, then start on its blocks)."""

from __future__ import annotations

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams, sample_copies
from tests.conftest import spec

BS = 4
PROMPT = [1] + [(5 * i) % 100 + 3 for i in range(21)]  # 22 tokens: 5 full blocks shareable (never the last's)
N = 4


def _run(target: str, draft: str | None, params: list[SamplingParams], n: int = N):
    with LLM(target, spec(draft, 3) if draft else None, block_size=BS) as llm:
        outs = llm.generate([PROMPT] * n, params)
        return [o.token_ids for o in outs], llm.engine.scheduler.prefix_stats


def test_greedy_copies_are_identical_and_share_the_prompts_blocks(llama) -> None:
    params = sample_copies(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), N)
    for draft in (None, llama.draft):
        outs, stats = _run(llama.target, draft, params)
        assert all(o == outs[0] for o in outs)
        shareable = (len(PROMPT) - 1) // BS * BS
        assert stats.requests == N and stats.hits == (N - 1) * shareable  # every copy but the first on its blocks


def test_copies_queued_together_without_the_wait_share_nothing(llama) -> None:
    """What the wait buys: plain duplicates admitted in one step all compute the prompt (the gate, shown off)."""
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * N
    _, stats = _run(llama.target, None, params)
    assert stats.hits == 0


def test_seeded_copies_differ_and_reproduce(llama) -> None:
    params = sample_copies(SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True), N)
    a, _ = _run(llama.target, llama.draft, params)
    b, _ = _run(llama.target, llama.draft, params)
    assert a == b
    assert len({tuple(o) for o in a}) == N  # each copy its own stream
    one, _ = _run(llama.target, llama.draft, [params[2]], n=1)
    assert one[0] == a[2]  # copy j alone == copy j among its siblings: streams keyed by (seed, position) only
    assert [p.seed for p in params] == [11, 12, 13, 14]
    assert sample_copies(SamplingParams(seed=2**63 - 1), 2)[1].seed == -(2**63)  # wraps within 64 bits


def test_unseeded_copies_differ(llama) -> None:
    params = sample_copies(SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True), N)
    outs, _ = _run(llama.target, None, params)
    assert len({tuple(o) for o in outs}) == N
