"""A stable ``topk`` for transformers' DeepSeek-V4 (training and the test oracle): ties go to the lower index.

Our engine's indexer breaks ties that way (workers/models/deepseek_v4*.py); the stock ``torch.topk`` leaves tie
order unspecified, and on small checkpoints (few index heads, ReLU scores that are exactly 0) ties are common.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def stable_indexer_topk() -> Iterator[None]:
    """Within the block, ``Tensor.topk`` (the indexer's call; the MoE router calls ``torch.topk``) is stable."""
    original = torch.Tensor.topk
    torch.Tensor.topk = _stable_topk  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]
