"""Attention over a flattened batch of new tokens, with and without a paged KV cache.

Models never see the cache layout: every attention layer calls ``ctx.attend(layer, q, k, v)`` on an
``AttentionContext`` built by the model runner for one forward pass. Two contexts exist:

- ``DenseCausalContext``: no cache; one or more independent sequences attend causally to themselves. Used by
  parity tests against transformers and by the training-free reference paths.
- ``PagedContext``: the new tokens' K/V are written into the paged cache at their slots, then each sequence's
  queries attend over the keys read from its slots under an explicit boolean mask. The mask is what makes
  tree verification work: a node sees the committed prefix and its own ancestors, never its siblings.

Everything that does not depend on the layer (key layout, query padding, the mask) is worked out once per
forward in ``workers.input_batch``; per layer the paged path is a write, a read (a view when the sequence's
slots are contiguous), and one SDPA call. GQA goes through SDPA's ``enable_gqa`` (no K/V expansion copy; the
same numbers as ``repeat_interleave``). A row-invariant model's float32 rows on a CPU instead take one native call
per layer for all rows (workers/kernels/row_attention.py ``native_attention``), reading the keys by slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.kernels.row_attention import native_attention, native_here
from workers.row_invariant import RowAttention


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the T new tokens (after RoPE) -> [T, Hq, D]."""
        ...


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float | None) -> torch.Tensor:
    """q: [B, Hq, Q, D], k/v: [B, Hkv, L, D], mask: [B, 1, Q, L] (bool or additive) or None -> [B, Hq, Q, D].

    Query head h reads kv head h // (Hq / Hkv), the grouping transformers uses.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class DenseCausalContext:
    """Causal self-attention over sequences laid end to end, no cache.

    ``seq_lens`` gives the length of each sequence in the flattened token batch (default: one sequence).
    """

    seq_lens: list[int] | None = None
    scale: float | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lens = self.seq_lens or [q.shape[0]]
        outs = []
        start = 0
        for n in lens:
            qs = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ks = k[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            vs = v[start:start + n].transpose(0, 1).unsqueeze(0)
            o = _sdpa(qs, ks, vs, None, True, self.scale)  # [1, Hq, n, D]
            outs.append(o[0].transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


@dataclass
class RowKeyLayout:
    """Which keys each of a forward's T rows sees, for the native op (one call for every row of the forward).

    ``rows`` [T, 4] int64: (offset of the row's block table in ``index``, prefix: positions [0, prefix) of its
    sequence are visible, offset of its extra positions in ``index``, their count); ``index`` [*] int64: block
    tables and extra positions (a tree node's scratch ancestors and itself, increasing). Position p is slot
    table[p // block_size] * block_size + p % block_size."""

    rows: torch.Tensor
    index: torch.Tensor
    block_size: int


@dataclass
class PagedMetadata:
    """Where one forward's new tokens go and what each of them may see.

    T new tokens from B sequences (those with at least one new token), padded to Q queries and L keys per
    sequence. Key l of sequence b is position l of its block table: the committed prefix, then its scratch nodes.
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot each new token's K/V is written to
    num_seqs: int  # B
    num_queries: int  # Q
    num_keys: int  # L
    # Where the keys are read from: a view of slots [kv_start, kv_start + L) when B == 1 and they are contiguous,
    # otherwise the blocks ``kv_blocks`` [B, nb] (long; padding: block 0, masked) gathered and laid end to end.
    kv_start: int | None = None
    kv_blocks: torch.Tensor | None = None
    # Query padding; both None when every sequence feeds Q new tokens, so the T rows are already B x Q in order.
    query_index: torch.Tensor | None = None  # [B * Q] long: flattened-batch row of each padded query (padding: 0)
    out_index: torch.Tensor | None = None  # [T] long: padded query slot (b * Q + i) of each flattened row
    # What each query sees. None: every key of its sequence (``causal``: key l only from query l on, for a
    # single fresh chain where keys and queries coincide).
    mask: torch.Tensor | None = None  # [B, 1, Q, L] bool: query q of sequence b may attend key l
    causal: bool = False
    # The sequences split into groups that attend apart (prompt chunks / decode rounds), each with its own layout;
    # ``group_rows[g]``: [T_g] long, the flattened-batch rows of group g's tokens in its order. When set, this
    # layout has only the write (slot_mapping) and the sizes; the groups' slot_mapping is None. Empty: one call.
    groups: list[PagedMetadata] = field(default_factory=list)
    group_rows: list[torch.Tensor] = field(default_factory=list)
    # Every row's keys, for the native row-invariant op (CPU forwards; None elsewhere).
    row_keys: RowKeyLayout | None = None


class KVCacheLike(Protocol):
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def slot_range(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    k: list[torch.Tensor]  # per layer [slots, Hkv, D]: what the native op reads by slot
    v: list[torch.Tensor]


@dataclass
class PagedContext:
    meta: PagedMetadata
    cache: KVCacheLike
    scale: float | None = None
    # One SDPA call per query row over exactly its visible keys (workers/row_invariant.py): a row's output then
    # does not depend on the other rows of the forward. Set for models whose output must not (quantized ones).
    row_invariant: bool = False
    _native: bool | None = field(default=None, init=False, repr=False)  # decided on the first layer
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _rows: RowAttention | None = field(default=None, init=False, repr=False)
    _groups: list[PagedContext] | None = field(default=None, init=False, repr=False)

    def _additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The bool mask as 0 / -inf in q's dtype, made once per forward (SDPA would convert it every layer)."""
        if self.meta.mask is None:
            return None
        if self._mask is None or self._mask.dtype != dtype:
            self._mask = torch.zeros(self.meta.mask.shape, dtype=dtype).masked_fill_(~self.meta.mask, float("-inf"))
        return self._mask

    def _uses_native(self, layer: int, q: torch.Tensor) -> bool:
        """A row-invariant model's float32 CPU rows, where the library is here: a property of the model, never of
        the batch (a row alone and inside any batch must take the same kernel)."""
        if self._native is None:
            self._native = (self.row_invariant and self.meta.row_keys is not None and q.dtype == torch.float32
                            and q.device.type == "cpu" and self.cache.k[layer].dtype == torch.float32
                            and native_here())
        return self._native

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        if self.row_invariant and self._uses_native(layer, q):
            rk = self.meta.row_keys
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            return native_attention(q, self.cache.k[layer], self.cache.v[layer], rk.rows, rk.index, rk.block_size,
                                    scale)  # [T, Hq, D]
        if not self.meta.groups:
            return self._read(layer, q)
        if self._groups is None:  # (row by row, a row's output does not depend on its group either)
            self._groups = [PagedContext(g, self.cache, self.scale, self.row_invariant) for g in self.meta.groups]
        out = torch.empty_like(q)  # [T, Hq, D]
        for ctx, rows in zip(self._groups, self.meta.group_rows, strict=True):
            out.index_copy_(0, rows, ctx._read(layer, q.index_select(0, rows)))
        return out

    def _read(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D] (K/V already written) -> [T, Hq, D] over this layout."""
        m = self.meta
        cache = self.cache
        b, nq, nk = m.num_seqs, m.num_queries, m.num_keys
        if b == 0:
            return q  # no new tokens
        if m.kv_start is not None:
            keys, values = cache.slot_range(layer, m.kv_start, nk)  # [1, Hkv, L, D] views of the cache: no copy
        else:
            keys, values = cache.gather_blocks(layer, m.kv_blocks)  # [B, nb * block_size, Hkv, D] each
            keys, values = keys[:, :nk].transpose(1, 2), values[:, :nk].transpose(1, 2)  # [B, Hkv, L, D]
        if self.row_invariant:
            if self._rows is None:
                slots = m.out_index.tolist() if m.out_index is not None else list(range(q.shape[0]))
                self._rows = RowAttention(slots, nq, nk, m.mask, m.causal)
            return self._rows(q, keys, values, self.scale)  # [T, Hq, D]
        t, hq, d = q.shape
        qp = q if m.query_index is None else q.index_select(0, m.query_index)
        o = _sdpa(qp.view(b, nq, hq, d).transpose(1, 2), keys, values, self._additive_mask(q.dtype), m.causal,
                  self.scale)  # [B, Hq, Q, D]
        o = o.transpose(1, 2).reshape(b * nq, hq, d)  # [B * Q, Hq, D]
        return o if m.out_index is None else o.index_select(0, m.out_index)  # [T, Hq, D]
