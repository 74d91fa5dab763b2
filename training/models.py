"""Architectures of the built-in target and draft (Llama family: RoPE, SwiGLU, RMSNorm, tied embeddings)."""

from __future__ import annotations

from transformers import LlamaConfig

CONTEXT = 512


def _config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=CONTEXT,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # with a 4k vocab the embedding is a large share of a tiny model
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def target_config(vocab: int, eos_id: int) -> LlamaConfig:
    # ~10.4M parameters: the low end of the 10-30M range, because on a 2-core CPU we are compute bound and a
    # bigger model would see too few tokens to beat a smaller one. GQA (2 queries per KV head) halves the
    # KV cache, which the engine's scratch-pad buffers care about.
    return _config(hidden=320, layers=8, heads=10, kv_heads=5, ffn=864, vocab=vocab, eos_id=eos_id)


def draft_config(vocab: int, eos_id: int) -> LlamaConfig:
    # ~1.9M parameters and only 4 layers: a draft must be cheap per token, and depth dominates its latency.
    return _config(hidden=160, layers=4, heads=5, kv_heads=5, ffn=432, vocab=vocab, eos_id=eos_id)
