"""The ``suffix`` method: the trie's counts and proposals, the cross-request cache's scoping and bounds, and
greedy output equal to no speculation through the engine (with and without a draft-model fallback)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.core.config import SpeculativeConfig, default_model_dirs
from engine.drafting.controller_drafter import ControllerDrafter
from engine.drafting.draftless_config import SuffixConfig
from engine.drafting.suffix import SuffixProposer
from engine.drafting.suffix_tree import SuffixTrie
from engine.llm import LLM
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from tests.conftest import marked_slow

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[1] + [5, 6, 7, 8, 9] * 6,
           [1, 40, 41, 42, 40, 41, 43, 40, 41], [1, 17, 44, 9, 83], [1] + list(range(20, 32)) * 2]


def test_vllm_keys_and_defaults() -> None:
    cfg = SpeculativeConfig.parse({"method": "suffix"})
    assert cfg.num_speculative_tokens == 24 and cfg.suffix_decoding_max_tree_depth == 24
    assert cfg.suffix_decoding_max_cached_requests == 10_000 and cfg.suffix_decoding_min_token_prob == 0.1
    with pytest.raises(ValueError, match="prompt_lookup_min is a key of method 'ngram'"):
        SpeculativeConfig.parse({"method": "suffix", "prompt_lookup_min": 2})
    with pytest.raises(ValueError, match="max_spec_factor"):
        SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_spec_factor": 0})


def test_trie_counts_and_the_tree_of_frequent_continuations() -> None:
    t = SuffixTrie(max_depth=4)
    t.append([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    # "1 2" was followed by 3 twice and 4 once: 3 first, 4 as its sibling; "1 2 3" went on with 1.
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    # Its own tokens: the longest earlier occurrence of a suffix ("2 3 1 2" before) went on with 4, and the
    # depth bound leaves one level below the match.
    own = t.propose(seq, True, max_nodes=8, max_depth=8, spec_factor=4.0, min_prob=0.1)
    assert (own.tokens, own.match_len) == ([4], 3)
    # Another context ending in "1 2": 3 (twice) before 4 (once) as siblings, each with its continuation.
    prop = t.propose([9, 1, 2], False, max_nodes=8, max_depth=8, spec_factor=4.0, min_prob=0.1)
    assert prop.match_len == 2 and (prop.tokens, prop.parents) == ([3, 4, 1, 1], [-1, -1, 0, 1])
    # min_prob cuts the rarer branch; the match length caps the size (spec_factor x match_len).
    assert t.propose([9, 1, 2], False, 8, 8, 4.0, 0.5).tokens == [3, 1]
    assert t.propose([9, 1, 2], False, 8, 8, 0.5, 0.0).tokens == [3]
    # add / remove are exact inverses (nodes included).
    shared = SuffixTrie(max_depth=3)
    shared.add([5, 6, 7, 8])
    n = shared.num_nodes
    shared.add([5, 6, 9])
    shared.remove([5, 6, 9])
    assert shared.num_nodes == n and shared.propose([5, 6], False, 4, 4, 4.0, 0.0).tokens == [7]
    shared.remove([5, 6, 7, 8])
    assert shared.num_nodes == 0 and shared.root.children is None


def _req(seq_id: int, prompt: list[int], tenant: str | None = None) -> Request:
    r = Request(seq_id, str(seq_id), prompt, SamplingParams(max_tokens=64), tenant=tenant)
    r.status = RequestStatus.RUNNING
    return r


def _batch(reqs: list[Request], depth: int = 4) -> SimpleNamespace:
    return SimpleNamespace(rounds=reqs, shapes=[(1,) * depth] * len(reqs), prefills=[])


def _finish(r: Request, reason: FinishReason) -> None:
    r.status, r.finish_reason = RequestStatus.FINISHED, reason


def test_cache_is_per_tenant_and_aborted_or_preempted_requests_leave_nothing() -> None:
    drafter = ControllerDrafter(SuffixProposer(SuffixConfig(max_tree_depth=6, min_token_prob=0.0,
                                                            max_spec_factor=4.0)))
    cache = drafter.proposer.cache
    a = _req(0, [1, 2], tenant="alice")
    drafter.propose(_batch([a]), [])
    a.output_token_ids = [30, 31, 32, 33, 34]
    _finish(a, FinishReason.STOP)
    # Alice's next request continues "30 31" from her cached output; Bob's, the same prompt, gets nothing.
    a2, b = _req(1, [7, 30, 31], tenant="alice"), _req(2, [7, 30, 31], tenant="bob")
    trees = drafter.propose(_batch([a2, b]), [0])
    assert trees[0].tokens[:3] == [32, 33, 34] and trees[1].num_nodes == 0
    assert cache.num_requests == 1 and drafter.proposer.num_requests == 2
    # Bob's aborted request is not cached; a preempted one keeps no state; a finished one is cached.
    b.output_token_ids = [50, 51, 52]
    _finish(b, FinishReason.ABORT)
    a2.status = RequestStatus.WAITING  # preempted
    nodes = cache.num_nodes
    drafter.propose(_batch([]), [2, 1])
    assert cache.num_nodes == nodes and cache.num_requests == 1 and drafter.proposer.num_requests == 0
    assert set(cache.tries) == {"alice"}
    # Cross-request caching off: nothing is kept past a request.
    off = ControllerDrafter(SuffixProposer(SuffixConfig(cross_request=False)))
    c = _req(3, [1, 2])
    off.propose(_batch([c]), [])
    c.output_token_ids = [9, 9, 9]
    _finish(c, FinishReason.STOP)
    off.propose(_batch([]), [3])
    assert off.proposer.cache.num_nodes == 0 and off.proposer.num_requests == 0


def test_memory_stays_bounded_over_10000_requests() -> None:
    """Synthetic token streams through the drafter (not the model): nodes stay under the bound the cache's
    request and token limits set, old requests are evicted, and nothing of a request outlives it."""
    cfg = SuffixConfig(max_tree_depth=4, max_cached_requests=200, max_cached_tokens=3000, min_token_prob=0.0)
    drafter = ControllerDrafter(SuffixProposer(cfg))
    proposer, rng = drafter.proposer, random.Random(0)
    peak_nodes = peak_own = 0
    running: list[Request] = []
    for i in range(10_000):
        tenant = f"t{i % 7}"
        r = _req(i, [rng.randrange(50) for _ in range(8)], tenant=tenant)
        running.append(r)
        drafter.propose(_batch(running), [])
        for q in running:
            q.output_token_ids.extend(rng.randrange(50) for _ in range(3))
        gone = []
        if len(running) >= 4:  # the oldest leaves: finished, aborted or preempted
            q = running.pop(0)
            kind = q.seq_id % 3
            if kind == 2:
                q.status = RequestStatus.WAITING
            else:
                _finish(q, FinishReason.STOP if kind == 0 else FinishReason.ABORT)
            gone.append(q.seq_id)
        drafter.propose(_batch([]), gone)
        peak_nodes = max(peak_nodes, proposer.cache.num_nodes)
        peak_own = max(peak_own, proposer.num_requests)
    assert proposer.cache.num_requests <= 200 and proposer.cache.num_tokens <= 3000
    # every cached token adds at most max_tree_depth nodes
    assert peak_nodes <= 3000 * 4 and peak_own <= 4
    assert set(proposer.cache.tries) <= {f"t{i}" for i in range(7)}
    drafter.propose(_batch([]), [q.seq_id for q in running])  # preempted: their state goes too
    for q in running:
        q.status = RequestStatus.WAITING
    assert proposer.num_requests == 0


@pytest.mark.parametrize("case", marked_slow(["llama", "llama-fallback", "builtin", "builtin-fallback"],
                                             {"builtin", "builtin-fallback"}))
def test_greedy_output_equals_no_speculation(request: pytest.FixtureRequest, case: str) -> None:
    family = case.split("-")[0]
    if family == "builtin":
        target, draft = default_model_dirs()
    else:
        models = request.getfixturevalue(family)
        target, draft = models.target, models.perturbed
    plain = [o.token_ids for o in LLM(target, None, block_size=4).generate(PROMPTS, GREEDY)]
    cfg: dict = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_spec_factor": 2.0}
    if case.endswith("fallback"):
        cfg["fallback"] = {"model": draft, "num_speculative_tokens": 3}
    llm = LLM(target, cfg, block_size=4, num_kv_tokens=320)  # small: requests are preempted and recomputed
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    # run twice: the second pass drafts from the first one's cached outputs
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    by_source = llm.engine.stats.by_source
    assert by_source["suffix"].num_rounds > 10, llm.engine.stats.as_dict()
    model_rounds = by_source["draft_model"].num_rounds if "draft_model" in by_source else 0
    assert (model_rounds > 10) == case.endswith("fallback"), by_source


def test_through_the_engine_aborted_requests_are_not_cached(llama) -> None:
    """An aborted request's output never reaches the cache, a finished one's does, and no per-request state
    outlives the requests (the engine's finished and aborted ids reach the drafter)."""
    cfg = {"method": "suffix", "num_speculative_tokens": 4}
    llm = LLM(llama.target, cfg, block_size=4, num_kv_tokens=128)  # small: preemption happens on the way
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("r0")
    outs: dict[str, object] = {}
    for _ in range(500):
        if not engine.has_unfinished:
            break
        outs.update({o.request_id: o for o in engine.step_finished()})
    # The last finished ids reach the drafter with the next step that runs: before any round of a new request.
    engine.add_request("probe", PROMPTS[0], GREEDY)
    engine.step()
    proposer = engine.drafter.proposer
    assert outs["r0"].finish_reason == "abort" and proposer.num_requests == 0
    assert proposer.cache.num_requests == len(PROMPTS) - 1


def test_a_seeded_sampled_request_is_reproduced_whatever_was_cached_before(llama) -> None:
    cfg = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0}
    seeded = SamplingParams(max_tokens=30, temperature=1.0, seed=77, ignore_eos=True)
    prompt = [1, 40, 41, 42, 40, 41, 43, 40, 41]
    alone = LLM(llama.target, cfg).generate([prompt], seeded)[0].token_ids
    llm = LLM(llama.target, cfg)
    llm.generate(PROMPTS + [prompt] * 3, GREEDY)  # the cache now holds continuations of this prompt
    assert llm.engine.drafter.proposer.cache.num_requests >= len(PROMPTS)  # (the last settle with the next step)
    assert llm.generate([prompt], seeded)[0].token_ids == alone
