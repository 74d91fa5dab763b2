"""Which implementation serves which ``architectures`` entry of config.json, and the interface they share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from workers.attention import AttentionContext
from workers.distributed import TPGroup
from workers.layers import WeightSource
from workers.model_config import ModelConfig
from workers.models.deepseek_v4 import DeepseekV4ForCausalLM
from workers.models.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """What the model runner calls (every implementation is also an ``nn.Module``)."""

    config: ModelConfig
    tp: TPGroup

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None: ...


# One implementation covers these families; ModelConfig's flags carry the differences.
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


# Compressed-state models: their own config (``DeepseekV4ModelConfig``) and per-sequence state
# (``workers.compressed_state``) instead of the paged KV cache; loaded by ``workers.loader.load_model``.
COMPRESSED_STATE_ARCHITECTURES: dict[str, type[DeepseekV4ForCausalLM]] = {
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted([*_ARCHITECTURES, *COMPRESSED_STATE_ARCHITECTURES]))


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The implementation for ``config.architecture``; ValueError listing the supported ones otherwise."""
    try:
        return _ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(f"architecture {config.architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}") from None
