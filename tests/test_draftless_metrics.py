"""Draftless drafting on the server's surface: Prometheus counters per drafting source, and the tenant (a digest
of the API key and served model) that scopes the suffix cache."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.llm import LLM
from engine.server.auth import tenant_of
from engine.server.metrics import ServerMetrics, read_engine_stats
from scheduler.sampling_params import SamplingParams
from tests.helpers_server import metric_value

PROMPT = [1, 7, 4, 1, 7, 5, 2, 3, 9, 0, 6, 8, 10, 11, 4, 1, 7, 4]  # every id: a one-token lookup always matches
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0,
          "suffix_decoding_max_tree_depth": 6}


def _sample(text: str, source: str) -> tuple[float | None, float | None, float | None]:
    return tuple(metric_value(text, f"specserve:spec_decode_num_{k}_by_source_total", {"source": source})
                 for k in ("drafts", "draft_tokens", "accepted_tokens"))


def test_proposals_and_acceptances_are_counted_per_source_on_metrics(small_vocab) -> None:
    target, _ = small_vocab
    llm = LLM(target, NGRAM, max_model_len=64)
    try:
        metrics = ServerMetrics("m")
        llm.generate([PROMPT] * 2, GREEDY)
        metrics.observe_stats(read_engine_stats(llm.engine))
        s = llm.engine.stats.by_source["ngram"]
        assert s.num_rounds > 0 and s.num_drafted > 0  # proposals happened
        assert _sample(generate_latest(metrics.registry).decode(), "ngram") == (
            s.num_rounds, s.num_drafted, s.num_accepted)
        llm.generate([PROMPT], GREEDY)  # counters advance by what the engine's advanced, not by its totals
        metrics.observe_stats(read_engine_stats(llm.engine))
        assert _sample(generate_latest(metrics.registry).decode(), "ngram") == (
            s.num_rounds, s.num_drafted, s.num_accepted)
    finally:
        llm.shutdown()


def test_the_tenant_is_a_digest_of_key_and_model_and_scopes_the_suffix_cache(small_vocab) -> None:
    a, b = tenant_of("key-a", "m"), tenant_of("key-b", "m")
    assert a != b and a != tenant_of("key-a", "other-model") and a == tenant_of("key-a", "m")
    assert "key-a" not in a and tenant_of(None, "m") is None and tenant_of("", "m") is None
    target, _ = small_vocab
    llm = LLM(target, SUFFIX, max_model_len=64)
    try:
        llm.engine.config.tenant = a
        llm.generate([PROMPT], GREEDY)
        llm.engine.config.tenant = b
        llm.generate([PROMPT[:6]], GREEDY)
        llm.generate([PROMPT[:4]], GREEDY)  # a finished request is settled into the cache at the next step
        cache = llm.engine.drafter.proposer.cache
        assert set(cache.tries) == {a, b}  # each tenant's outputs in its own trie, under the digest only
    finally:
        llm.shutdown()
