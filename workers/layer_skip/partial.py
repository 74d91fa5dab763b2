"""A Llama-style model run over a range of its layers: the pieces self-speculation splits a forward into.

``run_layers(model, ..., 0, L)`` then ``run_layers(model, ..., L, N, hidden)`` is the model's own forward cut in two
(the same modules in the same order), so on a row-invariant path the two halves give the bits the whole gives.
"""

from __future__ import annotations

import torch

from workers.attention import AttentionContext


def run_layers(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
               start: int, stop: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: the input of layer ``stop`` (its residual stream), from ``hidden`` (the input of layer ``start``;
    None: the token embeddings, for start 0). Writes layers [start, stop)'s KV at the context's slots."""
    inner = model.model
    if hidden is None:
        if start != 0:
            raise ValueError(f"layers from {start} need the hidden states entering layer {start}")
        hidden = inner.embed_tokens(input_ids)  # [T, H]
    cos, sin = inner.rotary_emb(positions)  # [T, 1, D] each
    for layer in inner.layers[start:stop]:
        hidden = layer(hidden, cos, sin, ctx)
    return hidden


def num_layers(model: torch.nn.Module) -> int:
    return len(model.model.layers)
