"""Apply a grammar's packed token masks to logits rows (engine/structured/masks.py computes them).

A row's bit t (word t // 32, bit t % 32, llguidance's and xgrammar's layout) set means token t is allowed; the
others get -inf before any sampling transform, so temperature, top-k/p and min-p act on the masked law (vLLM's
order) and greedy takes the masked argmax.
"""

from __future__ import annotations

import torch


def apply_allowed(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """rows [R, V] logits, packed [R, W] int32 -> [R, V] with the disallowed entries -inf (a new tensor)."""
    r, v = rows.shape
    bits = torch.arange(32, dtype=torch.int32, device=rows.device)
    allowed = ((packed.to(rows.device).unsqueeze(-1) >> bits) & 1).bool().view(r, -1)  # [R, W * 32]
    if allowed.shape[1] < v:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
    return rows.masked_fill(~allowed[:, :v], float("-inf"))
