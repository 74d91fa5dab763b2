"""Tiny random Hugging Face checkpoints for tests (no network, fp32 by default, well under a second each).

    from tests.helpers_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "target", family="llama", vocab_size=128, seed=0)
    path = make_tiny_checkpoint(tmp_path / "draft", family="qwen3", num_hidden_layers=1, with_tokenizer=True)

Weights are drawn with a fixed seed at a scale that makes logits O(1) (transformers' default init gives
near-uniform logits, which would hide bugs), norms included, so two calls with the same arguments give the
same checkpoint. Token ids: 0 = <unk>, 1 = <s> (bos), 2 = </s> (eos).
"""

from __future__ import annotations

import os
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Small enough that a forward takes milliseconds; GQA (4 query heads over 2 kv heads) on purpose.
_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _config(family: str, vocab_size: int, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kwargs = {**_TINY, "vocab_size": vocab_size, **overrides}
    return classes[family](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)  # near 1, but not exactly, so a skipped norm weight shows
        elif p.dim() == 1:
            p.copy_(0.1 * noise)  # biases
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)  # unit-variance activations through every matmul


def make_tiny_checkpoint(path: str | os.PathLike[str], family: str = "llama", vocab_size: int = 128,
                         seed: int = 0, max_shard_size: str | int | None = None,
                         dtype: torch.dtype = torch.float32, with_tokenizer: bool = False,
                         **overrides: Any) -> str:
    """Save a random tiny ``family`` model to ``path`` (created) as an HF checkpoint; returns ``str(path)``.

    overrides: any config field, e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=1``,
    ``rope_scaling={"rope_type": "llama3", ...}``, ``attention_bias=True``.
    max_shard_size: e.g. "20KB" to get several safetensors shards plus model.safetensors.index.json.
    dtype: dtype of the saved weights (config.json records it).
    with_tokenizer: also save a character-level tokenizer (printable ASCII, needs vocab_size >= 100).
    """
    from transformers import AutoModelForCausalLM

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = _config(family, vocab_size, overrides)
    torch.manual_seed(seed)  # transformers' own init runs before ours; keep it reproducible too
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if with_tokenizer:
        make_char_tokenizer(vocab_size).save_pretrained(path)
    return path


def make_char_tokenizer(vocab_size: int) -> Any:
    """A character-level fast tokenizer: <unk>=0, <s>=1, </s>=2, then printable ASCII; built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if vocab_size < len(vocab) + len(chars):
        raise ValueError(f"a character tokenizer needs vocab_size >= {len(vocab) + len(chars)}, got {vocab_size}")
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
