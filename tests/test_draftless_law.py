"""Sampled output under n-gram and suffix proposals follows the target's law exactly (one-hot q, the
deterministic-children rule), on a prompt built so that proposals happen (counted), and the test fails when the
recorded q is wrong.

The harness is tests/test_engine_sampling.py's (12-token target, exact law of the first four tokens by
enumeration, chi-square on adjacent pairs) with a prompt that holds every token id, so prompt lookup matches
the last token whatever it is (ngram with prompt_lookup_min 1), and repeats with several continuations, so
suffix trees have siblings.
"""

from __future__ import annotations

import numpy as np
import pytest

import workers.target_worker as target_worker
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.conftest import SMALL_VOCAB
from tests.helpers_law import continuation_logits
from tests.test_engine_sampling import ALPHA, pair_pvalues, reference_probs

PROMPT = [1, 7, 4, 1, 7, 5, 2, 3, 9, 0, 6, 8, 10, 11, 4, 1, 7, 4]
N = 1200  # requests per run

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_spec_factor": 3.0,
               "suffix_decoding_min_token_prob": 0.0, "suffix_decoding_max_tree_depth": 6},
}
LAWS = {"ngram": (1.0, -1, 1.0), "suffix": (0.7, 5, 1.0), "ngram-fallback": (1.0, -1, 1.0),
        "ngram-fallback-adaptive": (1.0, -1, 1.0)}


@pytest.fixture(scope="module")
def joint(small_vocab) -> dict[tuple[float, int, float], np.ndarray]:
    """Exact P[t1..t4] after PROMPT for each law used here."""
    logits = continuation_logits(small_vocab[0], PROMPT, SMALL_VOCAB)  # [V, V, V, 4, V]
    out = {}
    for law in set(LAWS.values()):
        p = reference_probs(logits, *law)
        out[law] = (p[0, 0, 0, 0][:, None, None, None] * p[:, 0, 0, 1][:, :, None, None]
                    * p[:, :, 0, 2][:, :, :, None] * p[:, :, :, 3])
    return out


def _sample(target: str, cfg: dict, law: tuple[float, int, float]) -> tuple[np.ndarray, LLM]:
    llm = LLM(target, cfg, max_num_seqs=N, max_num_batched_tokens=N * len(PROMPT), block_size=16,
              num_kv_tokens=N * 32, max_model_len=32)
    t, k, p = law
    params = [SamplingParams(max_tokens=4, temperature=t, top_k=k, top_p=p, seed=i, ignore_eos=True) for i in range(N)]
    tokens = np.array([o.token_ids for o in llm.generate([PROMPT] * N, params)])
    assert tokens.shape == (N, 4)
    return tokens, llm


@pytest.mark.parametrize("method", [*sorted(CONFIGS), "ngram-fallback", "ngram-fallback-adaptive"])
def test_draftless_output_follows_the_target_law(small_vocab, joint, method: str) -> None:
    target, draft = small_vocab
    cfg = dict(CONFIGS[method.split("-")[0]])
    if "fallback" in method:
        # Lookup of 2-grams only: rounds without a match go to the draft model, so one batch mixes one-hot
        # trees with trees whose laws come from the draft (adaptive: the policy routes each round to a source).
        cfg |= {"prompt_lookup_min": 2, "fallback": {"model": draft, "num_speculative_tokens": 2}}
    if method.endswith("adaptive"):
        cfg |= {"adaptive": True, "adaptive_warmup_s": 0.5, "adaptive_cost_cache": False}
    tokens, llm = _sample(target, cfg, LAWS[method])
    stats = llm.engine.stats
    # Proposals happened in most rounds, some accepted and some rejected.
    sources = {k: v.num_rounds for k, v in stats.by_source.items()}
    if "fallback" in method:
        assert min(sources.get("ngram", 0), sources.get("draft_model", 0)) >= N // 12, sources
    else:
        assert sources[method] >= N, stats.as_dict()
    assert 0 < stats.num_accepted < stats.num_drafted, stats.as_dict()
    if method == "suffix":  # trees with siblings, not only chains
        assert stats.num_drafted > stats.num_rounds * 1.5, stats.as_dict()
    pvalues = pair_pvalues(tokens, joint[LAWS[method]])
    assert min(pvalues.values()) > ALPHA, pvalues


def test_a_wrong_recorded_q_fails(small_vocab, joint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording q as half one-hot, half uniform (the token keeps q > 0, so nothing refuses it) inflates
    acceptance: the distribution test catches it."""
    target, _ = small_vocab
    real = target_worker.one_hot_laws

    def blurred(tokens, vocab_size, device):
        return 0.5 * real(tokens, vocab_size, device) + 0.5 / vocab_size

    monkeypatch.setattr(target_worker, "one_hot_laws", blurred)
    tokens, _ = _sample(target, CONFIGS["ngram"], LAWS["ngram"])
    assert min(pair_pvalues(tokens, joint[LAWS["ngram"]]).values()) < 1e-6
