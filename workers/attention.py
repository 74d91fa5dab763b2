"""Attention over a flattened batch of new tokens, with and without a paged KV cache.

Models never see the cache layout: every attention layer calls ``ctx.attend(layer, q, k, v)`` on an
``AttentionContext`` built by the model runner for one forward pass. Two contexts exist:

- ``DenseCausalContext``: no cache; one or more independent sequences attend causally to themselves. Used by
  parity tests against transformers and by the training-free reference paths.
- ``PagedContext``: the new tokens' K/V are written into the paged cache at their slots, then each sequence's
  queries attend over the keys gathered from its slots under an explicit boolean mask. The mask is what makes
  tree verification work: a node sees the committed prefix and its own ancestors, never its siblings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the T new tokens (after RoPE) -> [T, Hq, D]."""
        ...


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float | None) -> torch.Tensor:
    """q: [B, Hq, Q, D], k/v: [B, Hkv, L, D], mask: [B, 1, Q, L] bool or None -> [B, Hq, Q, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        # GQA: expand kv heads; repeat_interleave keeps the head grouping transformers uses.
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale)


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
class PagedMetadata:
    """Where one forward's new tokens go and what each of them may see.

    T new tokens from B sequences, padded to Q queries and L keys per sequence.
    """

    slot_mapping: torch.Tensor  # [T] long: flat cache slot each new token's K/V is written to
    kv_slots: torch.Tensor  # [B, L] long: flat slots of the keys each sequence attends over (padding: 0)
    mask: torch.Tensor  # [B, 1, Q, L] bool: query q of sequence b may attend key l
    query_index: torch.Tensor  # [B, Q] long: row of the flattened batch for each padded query (padding: 0)
    query_valid: torch.Tensor  # [B, Q] bool: False for padding queries


class KVCacheLike(Protocol):
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class PagedContext:
    meta: PagedMetadata
    cache: KVCacheLike
    scale: float | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        self.cache.write(layer, m.slot_mapping, k, v)
        keys, values = self.cache.gather(layer, m.kv_slots)  # [B, L, Hkv, D] each
        qp = q[m.query_index]  # [B, Q, Hq, D]
        o = _sdpa(qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), m.mask, False,
                  self.scale)  # [B, Hq, Q, D]
        o = o.transpose(1, 2)  # [B, Q, Hq, D]
        out = q.new_empty(q.shape)
        out[m.query_index[m.query_valid]] = o[m.query_valid]
        return out
