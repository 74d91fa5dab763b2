"""The engine serves a DeepSeek-V4 target with speculation: greedy output == the oracle's.

Target: a tiny random V4 (sliding window 3 < tree depth, CSA ratio 4, HCA ratio 8, 128 tokens) whose blocks
are scaled down so that its next token often follows the last one; draft: a 1-layer Llama (another
architecture, same vocabulary) built as a bigram table of the target, so acceptance is partial and accepted
paths of every length, crossing summary windows, get committed. Oracle: transformers' uncached forward with
the stable indexer top-k, greedy, one forward per token.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import SchedulerConfig
from tests.conftest import run_to_completion, spec, workers
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
    hf = mostly_bigram_v4(seed=3, vocab_size=128)  # the fixture's target: the extra four need references
    want = expected + [oracle_greedy(hf, p, MAX_TOKENS) for p in prompts[4:]]
    cfg = EngineConfig(target=target, speculative=SpeculativeConfig.parse(spec(draft, 4)),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
                       cache=CacheConfig(block_size=4))
    engine = LLMEngine(cfg)
    outs: dict = {}
    for i, p in enumerate(prompts[:5]):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step_finished()})
    for i, p in enumerate(prompts[5:], start=5):
        engine.add_request(str(i), p, GREEDY)
    outs.update(run_to_completion(engine))
    assert [outs[str(i)].token_ids for i in range(8)] == want
    assert engine.stats.num_accepted > 0


V4_SAMPLING_CASES = {  # sibling rule -> (branching, law); the rules and laws of test_engine_sampling's CASES
    "iid": ([2, 2], (1.0, -1, 1.0)),
    "without_replacement": ([3, 2], (0.7, -1, 1.0)),
    "deterministic": ([2, 1], (1.0, -1, 1.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(V4_SAMPLING_CASES))
def test_sampled_law_with_trees_on_v4(small_vocab, tmp_path, rule: str) -> None:
    """The 3-token sampled law with trees on a V4 target is the target's, for every sibling rule (chi-square,
    the harness of test_engine_sampling): a 12-token V4 with CSA ratio 2, HCA ratio 4 and window 2, so the
    generated positions complete summaries; draft: the small-vocabulary Qwen3 (another architecture)."""
    import itertools

    from tests.helpers_v4 import stable_indexer_topk, tiny_hf_model
    from tests.test_engine_sampling import ALPHA, PROMPT, N, exact_joint, pair_pvalues, sample_engine

    _, draft = small_vocab
    hf = tiny_hf_model(seed=4, vocab_size=12, sliding_window=2, index_topk=1,
                       compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4})
    hf.save_pretrained(tmp_path)
    conts = torch.tensor(list(itertools.product(range(12), repeat=3)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(conts), -1), conts], dim=1)
    with torch.inference_mode(), stable_indexer_topk():
        logits = hf(ids, use_cache=False).logits[:, len(PROMPT) - 1:].double().numpy()  # [V^3, 4, V]
    logits = logits.reshape(12, 12, 12, 4, 12)
    branching, law = V4_SAMPLING_CASES[rule]
    (tokens,), llm = sample_engine(str(tmp_path), spec(draft, None, branching, rule), [law])
    stats = llm.engine.stats
    assert stats.num_rounds >= N and 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    pvalues = pair_pvalues(tokens, exact_joint(logits, *law))
    assert min(pvalues.values()) > ALPHA, pvalues


@pytest.mark.parametrize("branching", [None, [2, 2, 1]], ids=["chain4", "tree221"])
def test_pipelined_speculation_equals_oracle(v4, branching) -> None:
    target, draft, expected = v4
    got, engine = _generate(target, {**spec(draft, 4 if branching is None else None, branching), "pipeline": True,
                                     "pipeline_switch": False})
    assert got == expected
    assert engine.pipeline is not None and engine.pipeline.stats.predrafted > 0


def test_preemption_restarts_the_compressed_state(v4, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool that cannot hold every request: preempted requests come back with base_len 0 and a fresh state."""
    from scheduler.scheduler import Scheduler

    target, draft, expected = v4
    preempted: list[int] = []
    real = Scheduler._preempt

    def counting_preempt(self, req):
        preempted.append(req.seq_id)
        real(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", counting_preempt)
    llm = LLM(target, spec(draft, None, [2, 2, 1]), block_size=4, num_kv_tokens=96)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert len(preempted) >= 2


@pytest.mark.parametrize("k,branching", [(4, None), (None, [2, 2, 1])], ids=["chain4", "tree221"])
def test_v4_draft_keeps_its_own_compressed_state(v4, k, branching) -> None:
    """The target itself as the draft: a compressed-state draft growing trees over several calls per round and
    committing what was accepted. Its top candidate is always the target's argmax: every round accepts its full
    depth."""
    from tests.test_engine_greedy import full_acceptance

    target, _, expected = v4
    got, engine = _generate(target, spec(target, k, branching))
    assert got == expected
    rounds, accepted = full_acceptance(MAX_TOKENS, k or len(branching))
    s = engine.stats
    assert (s.num_rounds, s.num_accepted) == (rounds * len(PROMPTS), accepted * len(PROMPTS)), s.as_dict()


def test_pipelined_v4_draft_rolls_its_state_back(v4) -> None:
    """Pipelined, the draft commits predicted tokens and the engine may then take the last back (base_len below
    the committed position): the runner undoes its last commit and keeps the head."""
    target, _, expected = v4
    got, engine = _generate(target, {**spec(target, 3), "pipeline": True, "pipeline_switch": False})
    assert got == expected
    assert engine.pipeline is not None and engine.pipeline.stats.hits > 0
    assert workers(engine)[1].runner.rollbacks > 0


def test_pipeline_switching_with_a_compressed_state_draft(v4) -> None:
    """Steps forced pipelined and sequential in turn (pipeline_switch.py): the compressed-state draft follows
    both kinds of commit and the hand-overs between them; outputs equal the oracle."""
    target, draft, expected = v4
    llm = LLM(target, {**spec(draft, None, [2, 2, 1]), "pipeline": True})
    llm.engine.pipeline.switch.force = lambda i: i % 6 in (0, 1, 4)  # P P S S P S: runs of 1 and 2
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    s = llm.engine.pipeline.stats
    assert 0 < s.pipelined_steps < s.steps and s.predrafted > 0
