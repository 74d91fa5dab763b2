"""Row-invariant forward pieces: a row's numbers do not depend on which other rows share the forward.

Why: greedy with speculation must equal greedy without, and a request's output must not depend on what else is
batched with it. A verify forward scores k+1 (or tree-size) rows of a request where a decode step scores one,
and a decode step at batch 16 has 16 rows where a lone request has one. Float sums are not associative, so any
kernel whose summation order depends on the number of rows (M) or on key padding gives a row different bits in
different batches; the 4-bit target (bfloat16 activations into every linear) turns such 1e-7 differences into
whole bfloat16 ulps downstream, and near-ties in the logits flip (measured on the real SmolLM2 Q4_1 file).

Measured here (torch 2.13 CPU, MKL, AVX-512; tests/test_row_invariance.py):
- the packed-int4 matmul (workers/quantized_linear.py) is row-invariant: each row's bits are the same alone or
  inside 2..64 rows;
- float32 ``F.linear`` is not: MKL has three regimes, M = 1 (a gemv), M = 2..15 and M >= 16, each summing in
  its own order (about 1e-5 apart on the 49,152 x 576 head);
- ``F.scaled_dot_product_attention`` is not: a query row's output changes with the number of query rows of its
  sequence (decode 1 vs verify k+1), with the key padding of a batch, and with masked keys in between.

So a row-invariant model computes (``row_invariant_logits``) the head as one gemv per row over fixed
512-row slices of the weight (the slices stay in cache while every row reads them; a gemv's result depends only
on its row: this is also exactly what a one-row decode step computed before), and (``RowAttention``) each query
row's attention as its own one-query SDPA call over exactly the keys it may see, in position order, unpadded
(a decode step's call): a verify node, a prefill row of any chunk, and a decode row at any batch size then all
take the identical code path with identical operands. Everything else in the Llama forward (embedding, RMSNorm,
RoPE, SiLU, residual adds, the int4 matmuls) is elementwise or per-row already.

Cost: batch-1 decode is unchanged (it already ran exactly these calls); extra rows pay a gemv each for the head
(instead of sharing one GEMM pass). Rows whose keys are prefixes of one length (a decode step's sequences of equal
length) share SDPA calls of probe-checked sizes (workers/kernels/row_attention.py); other rows pay a call each
per layer.

Float32 rows on an AVX-512 CPU where the kernel library builds skip ``RowAttention`` altogether: one native call
per layer computes every row of the forward, each (row, head) alone in a fixed order (workers/kernels/
row_attention.py ``native_attention``; workers/attention.py picks it per model, never per batch). ``RowAttention``
stays for bfloat16, GPUs, and machines without the library.
"""

from __future__ import annotations

import torch

from workers.kernels.row_attention import DEFAULT_ATTENTION, AttentionConfig, Sdpa, cut, group_keys, group_sizes, sdpa

HEAD_SLICE_ROWS = 512  # weight rows per gemv slice: 512 x 576 float32 is ~1.2 MB, which stays in L2 across rows


def row_invariant_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, E] @ weight [V, E]^T -> [N, V] in hidden's dtype, one gemv per (row, weight slice)."""
    n, v = hidden.shape[0], weight.shape[0]
    out = hidden.new_empty(n, v)  # [N, V]
    for start in range(0, v, HEAD_SLICE_ROWS):
        w = weight[start:start + HEAD_SLICE_ROWS]  # [S, E] (a view)
        for r in range(n):
            torch.mv(w, hidden[r], out=out[r, start:start + w.shape[0]])
    return out


class RowAttention:
    """Each query row's attention over exactly its visible keys, computed as its own one-query SDPA call would (a
    ``PagedMetadata``'s mask/causal/padding worked out once per forward). Rows whose keys are a prefix [0, n) of
    the same length share calls of sizes a probe showed give every row its lone call's bits
    (workers/kernels/row_attention.py); rows that see scattered keys (tree nodes) take one call each."""

    def __init__(self, slot_of_row: list[int], num_queries: int, num_keys: int, mask: torch.Tensor | None,
                 causal: bool, config: AttentionConfig = DEFAULT_ATTENTION, kernel: Sdpa = sdpa) -> None:
        self.config, self.kernel = config, kernel
        self.scattered: list[tuple[int, int, torch.Tensor]] = []  # (row t, sequence b, visible keys [n] long)
        by_length: dict[int, list[tuple[int, int]]] = {}  # n -> (sequence b, row t) of rows seeing keys [0, n)
        counts = prefix = None
        if mask is not None:
            m = mask[:, 0]  # [B, Q, L] bool
            counts = m.sum(-1).tolist()  # [B][Q]: keys visible to each query
            prefix = m.long().cumprod(-1).sum(-1).tolist()  # [B][Q]: length of the leading visible run
        for t, slot in enumerate(slot_of_row):
            b, i = divmod(slot, num_queries)
            if mask is not None:
                n = counts[b][i]
                if prefix[b][i] != n:
                    self.scattered.append((t, b, mask[b, 0, i].nonzero()[:, 0]))
                    continue
            else:
                n = i + 1 if causal else num_keys
            by_length.setdefault(n, []).append((b, t))
        self.by_length = [(n, sorted(rows)) for n, rows in by_length.items()]
        # Per call: (n, sequences, rows t, sequence index [G] and rows [G] as tensors: None for a lone row), cut on
        # first use (the admitted sizes depend on q's dtype).
        self._calls: list[tuple[int, list[int], list[int], torch.Tensor | None, torch.Tensor | None]] | None = None

    def _plan(self, q: torch.Tensor, keys: torch.Tensor) -> list:
        sizes = (1,) if all(len(r) == 1 for _, r in self.by_length) else group_sizes(q, keys, self.kernel,
                                                                                    self.config)
        calls = []
        for n, rows in self.by_length:
            start = 0
            for s in cut(len(rows), sizes):
                seqs, ts = [b for b, _ in rows[start:start + s]], [t for _, t in rows[start:start + s]]
                start += s
                tensors = (None, None) if s == 1 else (torch.tensor(seqs, device=q.device),
                                                       torch.tensor(ts, device=q.device))
                calls.append((n, seqs, ts, *tensors))
        return calls

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
        """q [T, Hq, D] (flattened rows), keys/values [B, Hkv, L, D] -> [T, Hq, D]."""
        if self._calls is None:
            self._calls = self._plan(q, keys)
        out = torch.empty_like(q)
        for n, seqs, ts, seq_index, rows in self._calls:
            if rows is None:  # the lone call: views, no copies
                b, t = seqs[0], ts[0]
                o = self.kernel(q[t, None, :, None], keys[b:b + 1, :, :n], values[b:b + 1, :, :n], scale)
                out[t] = o[0, :, 0]  # o: [1, Hq, 1, D]
                continue
            o = self.kernel(q.index_select(0, rows)[:, :, None], group_keys(keys, seqs, seq_index, n),
                            group_keys(values, seqs, seq_index, n), scale)  # [G, Hq, 1, D]
            out.index_copy_(0, rows, o[:, :, 0])
        for t, b, sel in self.scattered:
            k, v = keys[b:b + 1].index_select(2, sel), values[b:b + 1].index_select(2, sel)  # [1, Hkv, n, D]
            out[t] = self.kernel(q[t, None, :, None], k, v, scale)[0, :, 0]
        return out
