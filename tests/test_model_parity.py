"""Our models give transformers' logits: prefill, flattened batches, paged incremental decode, trees."""

from __future__ import annotations

import pytest
import torch

from tests.helpers_models import make_tiny_checkpoint
from workers.attention import DenseCausalContext, PagedContext
from workers.input_batch import SeqForward, build_batch
from workers.kv_cache import KVCache
from workers.loader import load_model

TOL = 1e-4
VOCAB = 96

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # head_dim 16: some bands scaled, some interpolated
CASES = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
                                   "tie_word_embeddings": True}),
    "llama-linear-rope-bias": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                         "attention_bias": True, "mlp_bias": True}),
    "llama-dynamic-rope-mha": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                                         "num_key_value_heads": 4}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    family, overrides = CASES[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=family, vocab_size=VOCAB,
                                seed=1, **overrides)
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_prefill_matches_transformers(models) -> None:
    ours, hf = models
    ids = random_ids(12, 0)
    hidden = ours(torch.tensor(ids), torch.arange(len(ids)), DenseCausalContext())
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (12, VOCAB)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=TOL, rtol=0)


@torch.no_grad()
def test_flattened_batch_of_different_lengths(models) -> None:
    ours, hf = models
    seqs = [random_ids(n, 10 + n) for n in (5, 11, 2)]
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    logits = ours.compute_logits(ours(ids, positions, DenseCausalContext([len(s) for s in seqs])))
    start = 0
    for s in seqs:
        torch.testing.assert_close(logits[start:start + len(s)], hf_logits(hf, s), atol=TOL, rtol=0)
        start += len(s)


def _paged_forward(model, cache: KVCache, seqs: list[SeqForward], block_size: int) -> torch.Tensor:
    batch = build_batch(seqs, block_size)
    hidden = model(batch.input_ids, batch.positions, PagedContext(batch.meta, cache))
    return model.compute_logits(hidden[batch.logit_rows])  # [R, V]


@torch.no_grad()
def test_incremental_decode_through_paged_cache(models) -> None:
    """Two sequences prefill their prompts, then decode one token per step, batched together."""
    ours, hf = models
    cfg = ours.config
    block_size = 4
    cache = KVCache(cfg.num_layers, 16, block_size, cfg.num_kv_heads, cfg.head_dim)
    full = [random_ids(11, 20), random_ids(9, 21)]  # prompt + tokens decoded one at a time
    prompt_lens = [6, 3]
    tables = [[0, 1, 2], [5, 6, 7]]
    refs = [hf_logits(hf, s) for s in full]

    prefill = [SeqForward(block_table=tables[i], base_len=0, parents=list(range(-1, n - 1)),
                          token_ids=full[i][:n], logit_nodes=[n - 1]) for i, n in enumerate(prompt_lens)]
    logits = _paged_forward(ours, cache, prefill, block_size)
    for i, n in enumerate(prompt_lens):
        torch.testing.assert_close(logits[i], refs[i][n - 1], atol=TOL, rtol=0)

    lens = list(prompt_lens)
    while any(n < len(s) for n, s in zip(lens, full, strict=True)):
        active = [i for i in range(2) if lens[i] < len(full[i])]
        step = [SeqForward(block_table=tables[i], base_len=lens[i], parents=[-1],
                           token_ids=[full[i][lens[i]]], logit_nodes=[0]) for i in active]
        logits = _paged_forward(ours, cache, step, block_size)
        for row, i in enumerate(active):
            torch.testing.assert_close(logits[row], refs[i][lens[i]], atol=TOL, rtol=0)
            lens[i] += 1  # a single chain node is already at its committed slot: nothing to move


@torch.no_grad()
def test_tree_nodes_see_only_their_ancestors(models) -> None:
    """Siblings share a position; each node's logits are those of prefix + its root-to-node path."""
    ours, hf = models
    cfg = ours.config
    block_size = 4
    cache = KVCache(cfg.num_layers, 8, block_size, cfg.num_kv_heads, cfg.head_dim)
    prefix = random_ids(5, 30)
    table = [3, 1, 4]
    _paged_forward(ours, cache, [SeqForward(table, 0, list(range(-1, 4)), prefix)], block_size)

    parents = [-1, 0, 0, 1, 2, 2]  # node 0 = pending token; 1, 2 siblings; 4, 5 siblings under 2
    tokens = random_ids(len(parents), 31)
    logits = _paged_forward(ours, cache, [SeqForward(table, len(prefix), parents, tokens,
                                                      logit_nodes=list(range(len(parents))))], block_size)
    for j in range(len(parents)):
        path = [j]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ids = prefix + [tokens[n] for n in reversed(path)]
        torch.testing.assert_close(logits[j], hf_logits(hf, ids)[-1], atol=TOL, rtol=0)


@torch.no_grad()
def test_positions_beyond_original_context_for_llama3_rope(tmp_path) -> None:
    """llama3 scaling only matters at long range: compare at positions well past the original 64."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, vocab_size=VOCAB, seed=2, num_hidden_layers=1,
                                rope_scaling=LLAMA3_ROPE, max_position_embeddings=512)
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_ids(200, 3)
    logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(200), DenseCausalContext()))
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=TOL, rtol=0)


@torch.no_grad()
def test_half_precision_stays_close_to_float32(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=VOCAB, seed=4)
    ids = torch.tensor(random_ids(10, 5))
    ref = load_model(path)
    ref_logits = ref.compute_logits(ref(ids, torch.arange(10), DenseCausalContext()))
    half = load_model(path, dtype=torch.bfloat16)
    assert half.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    logits = half.compute_logits(half(ids, torch.arange(10), DenseCausalContext()))
    assert logits.dtype == torch.float32
    assert (logits - ref_logits).abs().max() < 0.15 * ref_logits.abs().max()
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.8
