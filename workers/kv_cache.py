"""Paged KV cache storage (the tensors; block accounting lives in ``scheduler/block_manager.py``).

All layers share one tensor ``[2, num_layers, num_slots, Hkv, D]`` where a slot is ``block * block_size +
offset``. Keeping every layer in one tensor lets ``move`` commit an accepted path for all layers in a single
indexed copy.

Protocol every per-layer state follows (K/V here; compressed summaries and recurrent vectors later):
- ``write``: the round's new tokens (committed or tree scratch nodes) land at their slots;
- ``move``: commit: the accepted nodes' state is copied from their scratch slots to the sequence's next
  positions; the rest of the scratch is simply forgotten (its blocks are released by the block manager).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(2, num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=device)  # [2, layers, slots, Hkv, D]

    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] long; k/v: [T, Hkv, D]."""
        self.kv[0, layer, slots] = k.to(self.kv.dtype)
        self.kv[1, layer, slots] = v.to(self.kv.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, L] long -> k, v: [B, L, Hkv, D]."""
        return self.kv[0, layer][slots], self.kv[1, layer][slots]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the state at slots ``src`` [M] to slots ``dst`` [M] in every layer.

        The right-hand side is gathered before anything is written, so overlapping src/dst is safe.
        """
        if src.numel() == 0:
            return
        self.kv[:, :, dst] = self.kv[:, :, src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
