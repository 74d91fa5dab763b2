"""Paged KV cache storage (the tensors; block accounting lives in ``scheduler/block_manager.py``).

All layers share one tensor ``[2, num_layers, num_slots, Hkv, D]`` where a slot is ``block * block_size +
offset``. Keeping every layer in one tensor lets ``move`` commit an accepted path for all layers in a single
indexed copy.

Protocol every per-layer state follows (K/V here; compressed summaries and recurrent vectors later):
- ``write``: the round's new tokens (committed or tree scratch nodes) land at their slots;
- ``move``: commit: the accepted nodes' state is copied from their scratch slots to the sequence's next
  positions; the rest of the scratch is simply forgotten (its blocks are released by the block manager).

Reads come in two kinds, chosen per forward by ``workers.input_batch``: a sequence whose slots are one
contiguous run is read as a view (``slot_range``, no copy), otherwise whole blocks are gathered
(``gather_blocks``): one index per block instead of one per slot.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv = torch.zeros(2, num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=device)  # [2, layers, slots, Hkv, D]
        # Per-layer views, made once: indexing self.kv per call costs more than the decode-time copy itself.
        self.k = list(self.kv[0].unbind(0))  # layers x [slots, Hkv, D]
        self.v = list(self.kv[1].unbind(0))
        self.k_blocks = [t.view(num_blocks, block_size, num_kv_heads, head_dim) for t in self.k]
        self.v_blocks = [t.view(num_blocks, block_size, num_kv_heads, head_dim) for t in self.v]
        # [1, Hkv, slots, D]: SDPA's layout, so a contiguous run of slots is one narrow() away.
        self.k_heads = [t.transpose(0, 1).unsqueeze(0) for t in self.k]
        self.v_heads = [t.transpose(0, 1).unsqueeze(0) for t in self.v]

    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] long (distinct); k/v: [T, Hkv, D]."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks: [B, nb] long -> k, v: [B, nb * block_size, Hkv, D] (copies): each row's blocks laid end to end."""
        b, nb = blocks.shape
        flat = blocks.reshape(-1)
        shape = (b, nb * self.block_size, *self.k[layer].shape[1:])
        return (self.k_blocks[layer].index_select(0, flat).view(shape),
                self.v_blocks[layer].index_select(0, flat).view(shape))

    def slot_range(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [start, start + length) as views (no copy) -> k, v: [1, Hkv, length, D]."""
        return self.k_heads[layer].narrow(2, start, length), self.v_heads[layer].narrow(2, start, length)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the state at slots ``src`` [M] to slots ``dst`` [M] in every layer.

        The right-hand side is gathered before anything is written, so overlapping src/dst is safe.
        """
        if src.numel() == 0:
            return
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))
