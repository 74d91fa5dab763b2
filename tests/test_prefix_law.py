"""The output law with prefix caching on: requests that start on cached blocks (target and draft) still sample
from the target's law, and a poisoned cache (another prompt's K/V reused under a wrong hash) is caught.

The method of tests/test_engine_sampling.py (exact law of the first four tokens from the target's logits, chi-square
on adjacent pairs), with a prompt of two full blocks that a first request leaves in the cache before the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import SMALL_VOCAB, spec
from tests.helpers_law import continuation_logits
from tests.test_engine_sampling import ALPHA, N, exact_joint, pair_pvalues
from tests.test_prefix_engine import poisoned

PROMPT = [1, 7, 4, 2, 9, 5, 3, 8, 6]  # 9 tokens: with blocks of 4, two full blocks are cached before the last one
OTHER = [1, 3, 3, 8, 0, 2, 9, 9, 6]  # same length, another prefix
BS = 4


@pytest.fixture(scope="module")
def prompt_logits(small_vocab) -> np.ndarray:
    """[V, V, V, 4, V]: logits after PROMPT + (t1, t2, t3), at the 4 positions that predict t1..t4."""
    return continuation_logits(small_vocab[0], PROMPT, SMALL_VOCAB)


def sample_cached(target: str, speculative: dict | None, warm: list[int], hash_fn=None) -> tuple[np.ndarray, LLM]:
    """One request with prompt ``warm`` fills the cache, then N seeded requests of PROMPT at T = 1; tokens [N, 4]."""
    llm = LLM(target, speculative, max_num_seqs=N, max_num_batched_tokens=N * len(PROMPT), block_size=BS,
              num_kv_tokens=N * 16 + 64, max_model_len=32)
    if hash_fn is not None:
        llm.engine.scheduler.hash_fn = hash_fn
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=1.0, seed=10 ** 6, ignore_eos=True))
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(N)]
    tokens = np.array([o.token_ids for o in llm.generate([PROMPT] * N, params)])
    assert tokens.shape == (N, 4)
    return tokens, llm


@pytest.mark.parametrize("branching", [None, [2, 2]])
def test_cached_prefix_follows_the_target_law(small_vocab, prompt_logits, branching) -> None:
    target, draft = small_vocab
    tokens, llm = sample_cached(target, None if branching is None else spec(draft, None, branching), PROMPT)
    stats = llm.engine.scheduler.prefix_stats
    assert stats.hits == N * 2 * BS, stats  # every request of the batch started on the two cached blocks
    if branching is not None:
        assert stats.draft_hits == N * 2 * BS, stats
        s = llm.engine.stats
        assert s.num_rounds >= N and 0 < s.num_accepted < s.num_drafted
    pvalues = pair_pvalues(tokens, exact_joint(prompt_logits, 1.0))
    assert min(pvalues.values()) > ALPHA, pvalues


def test_a_poisoned_cache_fails_the_law_test(small_vocab, prompt_logits) -> None:
    """Blocks named without their tokens: the batch reuses OTHER's K/V and its law is caught as wrong."""
    target, draft = small_vocab
    tokens, llm = sample_cached(target, spec(draft, None, [2, 2]), OTHER, hash_fn=poisoned)
    assert llm.engine.scheduler.prefix_stats.hits == N * 2 * BS
    pvalues = pair_pvalues(tokens, exact_joint(prompt_logits, 1.0))
    assert min(pvalues.values()) < 1e-6, pvalues
