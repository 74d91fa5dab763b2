"""DeepSeek-V4 attention: one shared K=V head, sliding window, and the CSA / HCA compressed branches.

Per layer, a query at position t attends (with a learned per-head sink in the softmax) over
- the raw K=V of positions t - W + 1 .. t (the sliding window),
- HCA layers: every summary whose window of m' tokens is complete (i < (t + 1) // m');
- CSA layers: the top-k of the complete summaries (windows of 2m, stride m) picked by the lightning indexer.

The committed state and the tree of new nodes are described in ``workers.compressed_state``; this file only
computes: projections for all new rows of the batch at once, then per sequence the summaries its nodes
complete, the indexer's picks and the attention itself.

The indexer's top-k is a *stable* sort: among equal scores the lower summary index wins. Scores tie often
(ReLU makes many exactly 0), and an unspecified tie order would make prefill, decode and tree verify pick
different summaries. Candidate columns are laid out committed summaries first, then the new ones in node
order; for one node the visible new ones are its ancestors, in depth order, so column order is index order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.compressed_state import CompressorScratch, CompressorState, LayerScratch, LayerState, TreePlan
from workers.distributed import TPGroup
from workers.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4ModelConfig, RopeTable


def wide(dtype: torch.dtype) -> torch.dtype:
    """The precision of V4's "fp32" parts (norms, mixes, accumulators, indexer scores): fp32, or the model's
    own dtype when wider (float64 reference runs, where every path must agree to ~1e-12)."""
    return torch.promote_types(dtype, torch.float32)


class Linear(nn.Module):
    """y = x W^T with an uninitialised weight (always overwritten by a checkpoint)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 with an fp32 weight, cast back once (as the checkpoint was trained)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(wide(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.to(wide(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_cos_sin(table: RopeTable, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rope_dim / 2] (one angle per interleaved channel pair)."""
    inv = torch.tensor(table.inv_freq, dtype=torch.float32, device=positions.device)
    freqs = positions.float().unsqueeze(-1) * inv
    return (freqs.cos() * table.scaling).to(dtype), (freqs.sin() * table.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rope_dim channels of x [T, ..., D]; cos/sin [T, rope_dim / 2]."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)  # (x0, x1) -> (-x1, x0)
    w = wide(x.dtype)
    rotated = (rope.to(w) * cos + pairs.to(w) * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


@dataclass
class SeqSlice:
    """One sequence of a forward pass: its rows of the flattened batch, its plan, state and scratch."""

    start: int
    plan: TreePlan
    layers: list[LayerState]
    scratch: list[LayerScratch]

    @property
    def stop(self) -> int:
        return self.start + self.plan.num_nodes


class Compressor(nn.Module):
    """Learned gated pooling of a window of projected rows into one summary (HCA: m rows; CSA: 2m rows)."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        cols = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = Linear(hidden, cols, dtype)
        self.gate_proj = Linear(hidden, cols, dtype)
        self.position_bias = nn.Parameter(torch.empty(ratio, cols, dtype=torch.float32), requires_grad=False)
        self.kv_norm = RMSNorm(dim, eps)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> kv, gate [T, C] fp32 (``wide``): the rows the accumulators keep."""
        w = wide(hidden.dtype)
        return self.kv_proj(hidden).to(w), self.gate_proj(hidden).to(w)

    def summarize(self, src_kv: torch.Tensor, src_gate: torch.Tensor, gather: torch.Tensor, index: torch.Tensor,
                  rope: RopeTable, dtype: torch.dtype) -> torch.Tensor:
        """Pool the rows ``gather`` [S, L] of src_kv / src_gate [R, C] (R - 1: the padding row) into the
        summaries with sequence indices ``index`` [S] -> [S, dim]."""
        g_kv, g_gate = src_kv[gather], src_gate[gather]  # [S, L, C]
        m, d = self.ratio, self.dim
        if self.overlap:
            # rows 0..m-1: the previous window, first half-channels; rows m..2m-1: this window, second half
            w_kv = torch.cat([g_kv[:, :m, :d], g_kv[:, m:, d:]], dim=1)  # [S, 2m, D]
            w_gate = torch.cat([g_gate[:, :m, :d] + self.position_bias[:, :d],
                                g_gate[:, m:, d:] + self.position_bias[:, d:]], dim=1)
        else:
            w_kv, w_gate = g_kv, g_gate + self.position_bias  # [S, m, D]
        pooled = (w_kv.to(dtype) * w_gate.softmax(dim=1, dtype=wide(dtype)).to(dtype)).sum(dim=1)  # [S, D]
        pooled = self.kv_norm(pooled)
        cos, sin = rope_cos_sin(rope, index * m, pooled.dtype)  # RoPE at each window's first position
        return apply_rope(pooled, cos, sin)

    def summarize_batch(self, states: list[CompressorState], kv: torch.Tensor, gate: torch.Tensor,
                        seqs: list[SeqSlice], kind: str, rope: RopeTable, dtype: torch.dtype) -> list[torch.Tensor]:
        """The summaries every sequence's new nodes complete, pooled in one go: kv/gate [T, C] are the batch's
        new rows -> per sequence [S_i, dim]."""
        sources_kv, sources_gate, gathers, indices, counts = [], [], [], [], []
        offset = 0
        for s, st in zip(seqs, states, strict=True):
            wp = s.plan.windows[kind]
            sources_kv += [st.acc_kv, kv[s.start:s.stop]]
            sources_gate += [st.acc_gate, gate[s.start:s.stop]]
            counts.append(wp.nodes.numel())
            if counts[-1]:
                gathers.append(torch.where(wp.gather < 0, -1, wp.gather + offset))
                indices.append(wp.index)
            offset += st.acc_kv.shape[0] + s.plan.num_nodes
        if not gathers:
            return [kv.new_zeros(0, self.dim, dtype=dtype) for _ in seqs]
        cols = kv.shape[1]
        sources_kv.append(kv.new_zeros(1, cols))  # the padding row (index -1): zero kv, gate -inf
        sources_gate.append(kv.new_full((1, cols), float("-inf")))
        pooled = self.summarize(torch.cat(sources_kv), torch.cat(sources_gate), torch.cat(gathers),
                                torch.cat(indices), rope, dtype)
        return list(pooled.split(counts))


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, dtype)


class Indexer(Compressor):
    """Lightning indexer: its own compressor (at index_head_dim) plus queries; scores each summary with
    sum_h w_h * ReLU(q_h . k) / sqrt(index_head_dim)."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps, cfg.dtype)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg.dtype)
        self.scorer = IndexerScorer(cfg.hidden_size, cfg.index_n_heads, cfg.dtype)


def stable_topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores, visible [N, L] -> [N, L] bool: the k best visible columns per row, ties to the lower column."""
    if scores.shape[1] == 0:
        return visible
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros_like(visible).scatter_(1, order, True)
    return chosen & visible


class DeepseekV4Attention(nn.Module):
    """Tensor parallelism: each rank holds num_heads / tp query heads (their q_b_proj rows, sinks, and the
    o_groups / tp output groups they feed); the K=V head, compressors and indexer are replicated, so every
    rank keeps the same compressed state. The output projection's partial sums are all-reduced."""

    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.tp = tp or TPGroup.single()
        self.kind = cfg.layer_kinds[layer]
        self.rope = cfg.rope_main if self.kind == SLIDING else cfg.rope_compress
        h, d, nh = cfg.hidden_size, cfg.head_dim, cfg.num_heads // self.tp.size
        self.o_groups = cfg.o_groups // self.tp.size
        self.num_heads, self.head_dim, self.scale = nh, d, d ** -0.5
        self.sinks = nn.Parameter(torch.empty(nh, dtype=torch.float32), requires_grad=False)
        self.q_a_proj = Linear(h, cfg.q_lora_rank, cfg.dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * d, cfg.dtype)
        self.kv_proj = Linear(h, d, cfg.dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # grouped output projection: each of o_groups head groups -> o_lora_rank, then one mix to hidden
        self.o_a_proj = Linear(nh * d // self.o_groups, self.o_groups * cfg.o_lora_rank, cfg.dtype)
        self.o_b_proj = Linear(self.o_groups * cfg.o_lora_rank, h, cfg.dtype)
        self.compressor: Compressor | None = None
        if self.kind != SLIDING:
            ratio = cfg.csa_ratio if self.kind == CSA else cfg.hca_ratio
            self.compressor = Compressor(h, d, ratio, self.kind == CSA, cfg.rms_norm_eps, cfg.dtype)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(cfg)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqs: list[SeqSlice]) -> torch.Tensor:
        """hidden [T, H] (all new rows of the batch), cos/sin [T, rope/2] of this layer's table -> [T, H]."""
        t = hidden.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(hidden))  # [T, q_lora_rank]
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(t, self.num_heads, self.head_dim), self.cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)  # [T, Hq, D]
        kv = apply_rope(self.kv_norm(self.kv_proj(hidden)), cos, sin)  # [T, D]
        comp = idx = None
        if self.compressor is not None:
            comp = self.compressor.project(hidden)  # ([T, C], [T, C]) fp32
        if self.kind == CSA:
            indexer: Indexer = self.compressor.indexer  # type: ignore[union-attr, assignment]
            idx = indexer.project(hidden)
            iq = indexer.q_b_proj(q_res).view(t, indexer.heads, indexer.dim)
            wd = wide(hidden.dtype)
            iq = apply_rope(iq, cos, sin).to(wd)  # [T, Hi, Di] (compress table, as the layer's)
            iw = indexer.scorer.weights_proj(hidden).to(wd) * indexer.heads ** -0.5  # [T, Hi]
        new_comp = new_idx = None
        if self.compressor is not None and comp is not None:
            new_comp = self.compressor.summarize_batch([s.layers[self.layer].comp for s in seqs], comp[0], comp[1],
                                                       seqs, self.kind, self.rope, hidden.dtype)
        if self.kind == CSA and idx is not None:
            new_idx = indexer.summarize_batch([s.layers[self.layer].index for s in seqs], idx[0], idx[1], seqs,
                                              self.kind, self.rope, hidden.dtype)
        keys: list[torch.Tensor] = []
        visible: list[torch.Tensor] = []
        for i, s in enumerate(seqs):
            a, b = s.start, s.stop
            st, plan = s.layers[self.layer], s.plan
            scratch = LayerScratch(kv[a:b])
            comp_keys = comp_visible = None
            if st.comp is not None and comp is not None and new_comp is not None:
                wp = plan.windows[self.kind]
                new = new_comp[i]
                scratch.comp = CompressorScratch(comp[0][a:b], comp[1][a:b], new)
                comp_keys = torch.cat([st.comp.summaries.rows(), new])  # [n_c + S, D]
                comp_visible = torch.cat([wp.visible_committed, wp.visible_new], dim=1)  # [N, n_c + S]
                if st.index is not None and idx is not None and new_idx is not None:
                    new_i = new_idx[i]
                    scratch.index = CompressorScratch(idx[0][a:b], idx[1][a:b], new_i)
                    keys_i = torch.cat([st.index.summaries.rows(), new_i]).to(wd)  # [n_c + S, Di]
                    scores = F.relu(torch.matmul(iq[a:b], keys_i.T)) * indexer.dim ** -0.5  # [N, Hi, n_c + S]
                    scores = (scores * iw[a:b].unsqueeze(-1)).sum(dim=1)  # [N, n_c + S]
                    comp_visible = stable_topk_mask(scores, comp_visible, indexer.topk)
            parts, vis_parts = [st.ring, kv[a:b]], [plan.ring_visible, plan.new_visible]
            if comp_keys is not None and comp_visible is not None:
                parts.append(comp_keys)
                vis_parts.append(comp_visible)
            keys.append(torch.cat(parts))  # [W + N + C, D]
            visible.append(torch.cat(vis_parts, dim=1))  # [N, W + N + C]
            s.scratch.append(scratch)
        out = self._attend(q, keys, visible, seqs)  # [T, Hq, D]
        out = apply_rope(out, cos, -sin)  # K=V carried RoPE into the output: rotate back by the query position
        g = self.o_groups
        grouped = out.reshape(t, g, -1).transpose(0, 1)  # [g, T, Hq * D / g]
        w = self.o_a_proj.weight.view(g, -1, grouped.shape[-1]).transpose(1, 2)  # [g, in, o_lora_rank]
        grouped = torch.bmm(grouped, w).transpose(0, 1).reshape(t, -1)  # [T, g * o_lora_rank]
        return self.tp.all_reduce(self.o_b_proj(grouped))

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor], visible: list[torch.Tensor],
                seqs: list[SeqSlice]) -> torch.Tensor:
        """q [T, Hq, D] (the sequences' rows in order); per sequence its keys [L_i, D] (K = V) and which of them
        each of its nodes sees [N_i, L_i] -> [T, Hq, D]. One padded batch: padding is never visible."""
        b = len(seqs)
        counts = [s.plan.num_nodes for s in seqs]
        n_max, l_max = max(counts), max(k.shape[0] for k in keys)
        k = nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [B, L, D]
        qp = nn.utils.rnn.pad_sequence(list(q.split(counts)), batch_first=True)  # [B, N, Hq, D]
        vis = torch.zeros(b, n_max, l_max, dtype=torch.bool, device=q.device)
        for i, v in enumerate(visible):
            vis[i, : v.shape[0], : v.shape[1]] = v
        logits = torch.matmul(qp.transpose(1, 2), k.unsqueeze(1).transpose(-1, -2)) * self.scale  # [B, Hq, N, L]
        logits = logits.masked_fill(~vis.unsqueeze(1), float("-inf"))
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1, 1).expand(b, -1, n_max, 1)  # [B, Hq, N, 1]
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]  # the sink only takes probability mass
        out = torch.matmul(probs.to(k.dtype), k.unsqueeze(1)).transpose(1, 2)  # [B, N, Hq, D]
        real = torch.arange(n_max, device=q.device).unsqueeze(0) < torch.tensor(counts, device=q.device).unsqueeze(1)
        return out[real]  # [T, Hq, D]: the padded rows dropped, sequences in order
