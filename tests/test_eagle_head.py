"""EAGLE heads in the published layout load and run (workers/eagle/head.py), tiny and random, made here."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from training.eagle_layout import random_head
from workers.eagle.head import load_head
from workers.eagle.head_config import EAGLE, EAGLE3, EagleHeadConfig
from workers.input_batch import SeqForward
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner

DRAFT_IDS = list(range(3, 67, 2))  # a trimmed draft vocabulary: 32 of the target's 128 ids


def _run(head, tokens: list[int], feats: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Logits at every position, fed in one call or two (prefix, then the rest): [len(tokens), V]."""
    c = head.head_config
    runner = ModelRunner(head, 1, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, "cpu")
    cuts = [0, len(tokens)] if split is None else [0, split, len(tokens)]
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        head.features = head.fuse(feats[a:b])
        out.append(runner.forward([SeqForward(list(range(8)), a, list(range(-1, b - a - 1)), tokens[a:b],
                                              logit_nodes=list(range(b - a)))]))
        runner.commit([])
    return torch.cat(out)


def test_published_eagle3_layout_loads_and_runs(llama, tmp_path):
    target = ModelConfig.from_pretrained(llama.target)
    path = random_head(tmp_path / "head", target, EAGLE3, seed=3, draft_ids=DRAFT_IDS)
    names = set(load_file(os.path.join(path, "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names and "embed_tokens.weight" not in names
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    head = load_head(path, llama.target, target)
    c = head.head_config
    assert c.kind == EAGLE3 and c.feature_size == 3 * target.hidden_size and c.draft_vocab_size == len(DRAFT_IDS)
    assert head.layers[0].self_attn.q_proj.in_features == 2 * target.hidden_size  # attends over [embed; hidden]
    # the target's embedding, read from the target checkpoint
    emb = load_file(os.path.join(llama.target, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(head.embed_tokens.weight, emb)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (9,), generator=gen).tolist()
    feats = torch.randn(9, c.feature_size, generator=gen)  # [T, 3H]
    logits = _run(head, tokens, feats)  # [9, V]
    on = torch.zeros(target.vocab_size, dtype=torch.bool)
    on[DRAFT_IDS] = True
    assert torch.isfinite(logits[:, on]).all() and torch.isneginf(logits[:, ~on]).all()
    assert logits[:, on].std() > 0.1  # O(1) logits, not a constant
    # its own KV cache: the same logits fed in two calls (prefix, then the rest) as in one
    torch.testing.assert_close(_run(head, tokens, feats, split=5), logits, rtol=1e-4, atol=1e-4)


def test_eagle1_layout_loads_and_runs(llama, tmp_path):
    target = ModelConfig.from_pretrained(llama.target)
    head = load_head(random_head(tmp_path / "head", target, EAGLE, seed=4), llama.target, target)
    assert head.head_config.kind == EAGLE and head.head_config.aux_layers(target.num_layers) == (-1,)
    assert head.fc.in_features == 2 * target.hidden_size and head.fc.bias is not None
    tokens = [5, 9, 17, 3, 44]
    logits = _run(head, tokens, torch.randn(5, target.hidden_size))
    assert logits.shape == (5, target.vocab_size) and torch.isfinite(logits).all()


def test_aux_layers_from_config_or_vllm_default():
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 128}
    assert EagleHeadConfig.from_dict(base).aux_layers(32) == (2, 16, 29)
    cfg = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}
    assert EagleHeadConfig.from_dict(cfg).aux_layers(32) == (1, 5, 9)
    with pytest.raises(ValueError, match="no EAGLE head"):
        EagleHeadConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})


def test_head_for_another_target_is_refused(llama, small_vocab, tmp_path):
    target = ModelConfig.from_pretrained(llama.target)
    path = random_head(tmp_path / "head", target, EAGLE3)
    other = ModelConfig.from_pretrained(small_vocab[0])
    with pytest.raises(ValueError, match="vocab_size"):
        load_head(path, small_vocab[0], other)
