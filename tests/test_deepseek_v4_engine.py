"""The engine serves a DeepSeek-V4 target with speculation: greedy output == the oracle's.

Target: a tiny random V4 (sliding window 3 < tree depth, CSA ratio 4, HCA ratio 8, 128 tokens) whose blocks
are scaled down so that its next token often follows the last one; draft: a 1-layer Llama (another
architecture, same vocabulary) built as a bigram table of the target, so acceptance is partial and accepted
paths of every length, crossing summary windows, get committed. Oracle: transformers' uncached forward with
the stable indexer top-k, greedy, one forward per token.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import SchedulerConfig
from tests.conftest import run_to_completion, spec
from tests.helpers_v4 import make_bigram_draft, mostly_bigram_v4, oracle_greedy

MAX_TOKENS = 24
PROMPTS = [[1, 17, 44, 9, 83], [1] + list(range(20, 32)), [1, 5], [1] + [(7 * i) % 120 + 3 for i in range(21)]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory: pytest.TempPathFactory):
    hf = mostly_bigram_v4(seed=3, vocab_size=128)
    target = tmp_path_factory.mktemp("v4_target")
    hf.save_pretrained(target)
    draft = make_bigram_draft(str(tmp_path_factory.mktemp("v4_draft")), hf)
    expected = [oracle_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return str(target), draft, expected


def _generate(target: str, speculative: dict | None, prompts=PROMPTS):
    llm = LLM(target, speculative)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm.engine


def test_no_speculation_equals_oracle(v4) -> None:
    target, _, expected = v4
    got, _ = _generate(target, None)
    assert got == expected


@pytest.mark.parametrize("k,branching", [(4, None), (7, None), (None, [2, 2, 1]), (None, [3, 1, 1, 1])],
                         ids=["chain4", "chain7", "tree221", "tree3111"])
def test_speculation_equals_oracle_with_partial_acceptance(v4, k, branching) -> None:
    target, draft, expected = v4
    got, engine = _generate(target, spec(draft, k, branching))
    assert got == expected
    depth = k or len(branching)
    mal = engine.stats.mean_acceptance_length
    assert 1.2 < mal < depth + 1, mal  # paths of several lengths were committed


def test_batch_of_eight_mixed_requests_with_chunked_prefill(v4) -> None:
    """Eight requests of different lengths, arriving while others run, prefilled in small chunks, chain K=4."""
    target, draft, expected = v4
    prompts = PROMPTS + [p[:3] + [40 + i] for i, p in enumerate(PROMPTS)]
    from tests.helpers_v4 import oracle_greedy as og  # the extra four need their own reference

    hf = mostly_bigram_v4(seed=3, vocab_size=128)
    want = expected + [og(hf, p, MAX_TOKENS) for p in prompts[4:]]
    cfg = EngineConfig(target=target, speculative=SpeculativeConfig.parse(spec(draft, 4)),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, block_size=4),
                       cache=CacheConfig(block_size=4))
    engine = LLMEngine(cfg)
    outs: dict = {}
    for i, p in enumerate(prompts[:5]):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step()})
    for i, p in enumerate(prompts[5:], start=5):
        engine.add_request(str(i), p, GREEDY)
    outs.update(run_to_completion(engine))
    assert [outs[str(i)].token_ids for i in range(8)] == want
    assert engine.stats.num_accepted > 0
