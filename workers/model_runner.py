"""Runs one model over a batch of ``SeqForward`` pieces against its own paged KV cache."""

from __future__ import annotations

import torch

from workers.attention import PagedContext
from workers.input_batch import SeqForward, build_batch, commit_moves
from workers.kv_cache import KVCache
from workers.messages import CommitSpec


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqForward]) -> torch.Tensor:
        """Writes every new node's KV; returns logits [R, V] (float32) for the requested nodes, in order."""
        if not seqs:
            return torch.empty(0)
        batch = build_batch(seqs, self.block_size, self.device)
        ctx = PagedContext(batch.meta, self.cache, row_invariant=getattr(self.model, "row_invariant", False))
        hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, H]
        if batch.logit_rows.numel() == 0:
            return hidden.new_empty(0, 0)
        if batch.logit_range is not None:
            start, stop = batch.logit_range
            wanted = hidden[start:stop] if stop - start < hidden.shape[0] else hidden
        else:
            wanted = hidden.index_select(0, batch.logit_rows)
        return self.model.compute_logits(wanted).float()  # [R, V]

    def commit(self, commits: list[CommitSpec]) -> None:
        src: list[int] = []
        dst: list[int] = []
        for c in commits:
            s, d = commit_moves(c.block_table, c.base_len, c.path, self.block_size)
            src += s
            dst += d
        if src:
            self.cache.move(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
