"""DeepSeek-V4 (compressed attention) against the oracle: transformers' uncached forward, stable indexer top-k.

Prefill in one piece, in chunks, and serial decode; a whole candidate tree verified in one forward (every
node's logits, and the state each root-to-leaf path commits); several sequences in one batch; a checkpoint
directory read by our loader. Sliding window 3 (smaller than the trees' depth), CSA ratio 4, HCA ratio 8 / 16;
prompts cross many window boundaries.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers_v4 import (
    assert_states_close,
    chain,
    feed,
    oracle_logits,
    ours_from_hf,
    path_to,
    random_tree,
    stable_indexer_topk,
    tiny_hf_model,
)
from workers.compressed_state import SeqState, commit, make_plan

# Exactness runs in float64 (ours and the oracle), so "same state" can be checked at 1e-6 and mean it; the
# oracle keeps some parts in fp32 (hyper-connections, indexer scores), hence its looser logit tolerance.
TOL = 1e-5  # logits (magnitude ~3) vs the oracle, float64
TOL_FP32 = 5e-5  # float32 models: rounding of differently shaped matmuls

CASES = {
    "csa4-hca8-w3": {},
    "hca16-w5-hc3": dict(sliding_window=5, index_topk=3, hc_mult=3,
                             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                             layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention", "sliding_attention"]),
    "w2-sigmoid-tied": dict(sliding_window=2, index_topk=1, scoring_func="sigmoid", tie_word_embeddings=True,
                            num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"],
                            layer_types=["compressed_sparse_attention", "sliding_attention",
                                         "heavily_compressed_attention"]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest):
    hf = tiny_hf_model(seed=len(request.param), **CASES[request.param]).double()
    ours, cfg = ours_from_hf(hf, torch.float64)
    return hf, ours, cfg


def _tokens(seed: int, n: int, vocab: int = 48) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_prefill_chunks_and_serial_decode_match_oracle(pair, chunk: int) -> None:
    hf, ours, cfg = pair
    tokens = _tokens(chunk, 41)
    ref = oracle_logits(hf, tokens)
    got = feed(ours, cfg, SeqState.empty(cfg), tokens, chunk)
    assert (got - ref).abs().max() < TOL


def test_chunked_prefill_state_equals_serial_state(pair) -> None:
    _, ours, cfg = pair
    tokens = _tokens(7, 37)
    serial, chunked = SeqState.empty(cfg), SeqState.empty(cfg)
    feed(ours, cfg, serial, tokens, 1)
    feed(ours, cfg, chunked, tokens, 6)
    assert_states_close(chunked, serial)


def test_tree_verify_in_one_forward_matches_oracle_and_serial_state(pair) -> None:
    hf, ours, cfg = pair
    gen = torch.Generator().manual_seed(3)
    prefix = _tokens(11, 22)
    base = SeqState.empty(cfg)
    feed(ours, cfg, base, prefix, 8)
    parents = random_tree(gen, 14, max_children=2)
    while max(len(path_to(parents, i)) for i in range(len(parents))) <= cfg.sliding_window + 1:
        parents = random_tree(gen, 14, max_children=2)  # deeper than the window
    tokens = torch.randint(2, cfg.vocab_size, (len(parents),), generator=gen).tolist()
    plan = make_plan(cfg, base.position, parents)
    logits, scratch = ours.run([(base, plan, tokens)])
    leaves = [i for i in range(len(parents)) if i not in parents]
    for leaf in leaves:
        path = path_to(parents, leaf)
        ref = oracle_logits(hf, prefix + [tokens[i] for i in path])[len(prefix):]
        assert (logits[path] - ref).abs().max() < TOL, f"path {path}"
        committed = base.clone()
        commit(committed, plan, scratch[0], path)
        serial = base.clone()
        feed(ours, cfg, serial, [tokens[i] for i in path], 1)
        assert_states_close(committed, serial)


def test_batch_of_sequences_matches_each_alone(pair) -> None:
    _, ours, cfg = pair
    gen = torch.Generator().manual_seed(5)
    states = []
    for i, n in enumerate((3, 9, 16, 21)):
        st = SeqState.empty(cfg)
        feed(ours, cfg, st, _tokens(20 + i, n), 4)
        states.append(st)
    requests = []
    for i, st in enumerate(states):
        parents = random_tree(gen, 3 + 2 * i) if i % 2 else chain(1 + i)
        toks = torch.randint(2, cfg.vocab_size, (len(parents),), generator=gen).tolist()
        requests.append((st, make_plan(cfg, st.position, parents), toks))
    batched, _ = ours.run(requests)
    alone = torch.cat([ours.run([r])[0] for r in requests])
    assert (batched - alone).abs().max() < TOL


def test_stable_top_k_matters_on_these_checkpoints(pair) -> None:
    """Ties happen: transformers' own unstable top-k gives other logits, so the oracle's rule is doing work."""
    hf, _, cfg = pair
    if "compressed_sparse_attention" not in hf.config.layer_types:
        pytest.skip("no CSA layer")
    tokens = _tokens(1, 48)
    with torch.inference_mode():
        plain = hf(torch.tensor([tokens]), use_cache=False).logits[0]
        with stable_indexer_topk():
            stable = hf(torch.tensor([tokens]), use_cache=False).logits[0]
    assert (plain - stable).abs().max() > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_prefill_and_decode_match_oracle(case: str) -> None:
    hf = tiny_hf_model(seed=len(case), **CASES[case])
    ours, cfg = ours_from_hf(hf)
    tokens = _tokens(4, 33)
    ref = oracle_logits(hf, tokens)
    for chunk in (33, 1):
        got = feed(ours, cfg, SeqState.empty(cfg), tokens, chunk)
        assert (got - ref).abs().max() < TOL_FP32


def test_checkpoint_directory_loads_with_transformers_names(tmp_path) -> None:
    from workers.loader import load_model

    hf = tiny_hf_model(seed=9)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    tokens = _tokens(2, 30)
    got = feed(model, model.config, SeqState.empty(model.config), tokens, 30)
    assert (got - oracle_logits(hf, tokens)).abs().max() < TOL_FP32
