"""DeepSeek-V4 decoder (``model_type: deepseek_v4``): hyper-connections, compressed attention, hash / top-k MoE.

Parameter names are exactly transformers' (and so the checkpoint's), so ``load_weights`` is a name-for-name
copy with a completeness check. What is specific to V4, by block:
- residual: ``hc_mult`` parallel streams per token [T, hc, H]; each block reads a learned mix of them
  (``pre``), writes its output back with per-stream weights (``post``) and mixes the streams with a
  Sinkhorn-projected doubly-stochastic matrix (``comb``) -- manifold-constrained hyper-connections;
- attention: ``workers.models.deepseek_v4_attention`` (sliding window + CSA / HCA summaries);
- MLP: routed experts (hash-routed by token id in the first layers, top-k routed after) plus a shared expert,
  SwiGLU with clamped pre-activations.

The forward pass takes a list of ``SeqSlice`` (one per sequence: its plan, committed state, and a list the
attention layers fill with the nodes' scratch rows); see ``workers.compressed_state``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from workers.compressed_state import LayerScratch, SeqState, TreePlan
from workers.distributed import TPGroup
from workers.kernels.row_linear import forget_packed
from workers.layers import WeightSource, read_full
from workers.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    Linear,
    RMSNorm,
    SeqSlice,
    rope_cos_sin,
    wide,
)
from workers.models.deepseek_v4_config import DeepseekV4ModelConfig


def _unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.to(wide(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class HyperConnection(nn.Module):
    """Weights that collapse the hc streams into a block's input and expand its output back."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = _param((2 + n) * n, n * cfg.hidden_size)
        self.base = _param((2 + n) * n)
        self.scale = _param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, H] -> post [T, hc], comb [T, hc, hc] (fp32), collapsed block input [T, H]."""
        n = self.n
        w = wide(streams.dtype)
        flat = _unweighted_norm(streams.flatten(1).to(w), self.norm_eps)
        mixes = F.linear(flat, self.fn.to(w))  # [T, (2 + hc) * hc]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        # Sinkhorn-Knopp: alternate column / row normalisation towards a doubly-stochastic matrix
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, hc, H]: the block output spread by ``post`` plus the old streams mixed by comb^T."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the hc streams into one hidden state."""

    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = _param(n, n * cfg.hidden_size)
        self.hc_base = _param(n)
        self.hc_scale = _param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        w = wide(streams.dtype)
        flat = _unweighted_norm(streams.flatten(1).to(w), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.to(w)) * self.hc_scale.to(w) + self.hc_base.to(w))
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, H]


class SharedExpert(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj, self.up_proj = Linear(h, i, cfg.dtype), Linear(h, i, cfg.dtype)
        self.down_proj = Linear(i, h, cfg.dtype)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Expert choice and weights: by the token id's fixed table (hash) or by top-k of biased scores."""

    def __init__(self, cfg: DeepseekV4ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.k, self.func = hashed, cfg.num_experts_per_tok, cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.weight = _param(cfg.num_experts, cfg.hidden_size, dtype=cfg.dtype)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> experts [T, k] long, weights [T, k]."""
        logits = F.linear(x, self.weight)  # [T, E]
        if self.func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        return experts, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class Experts(nn.Module):
    """Routed experts; with tensor parallelism each rank holds num_experts / tp of them and the routed sum is
    all-reduced."""

    def __init__(self, cfg: DeepseekV4ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        e, h, i = cfg.num_experts // tp.size, cfg.hidden_size, cfg.moe_intermediate_size
        self.tp, self.first = tp, tp.rank * e
        self.gate_up_proj = _param(e, 2 * i, h, dtype=cfg.dtype)
        self.down_proj = _param(e, h, i, dtype=cfg.dtype)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], experts / weights [T, k] -> [T, H]; each expert runs once over the rows routed to it."""
        out = torch.zeros_like(x)
        local = self.gate_up_proj.shape[0]
        for e in experts.unique().tolist():
            if not self.first <= e < self.first + local:
                continue  # another rank's expert
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e - self.first]).chunk(2, dim=-1)
            y = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
            y = F.linear(y, self.down_proj[e - self.first]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return self.tp.all_reduce(out)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate = Router(cfg, cfg.mlp_kinds[layer] == "hash_moe")
        self.experts = Experts(cfg, tp)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        return self.experts(x, experts, weights) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(cfg, layer, tp)
        self.mlp = MoE(cfg, layer, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqs: list[SeqSlice]) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = hc_merge(streams, self.self_attn(self.input_layernorm(x), cos, sin, seqs), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(streams, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    """``forward(input_ids, seqs)`` -> final hidden [T, H]; ``compute_logits`` -> [N, V] float32."""

    compressed_state = True  # runs under workers.compressed_state_runner, not the paged-KV ModelRunner

    def __init__(self, config: DeepseekV4ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        for what, n in (("num_attention_heads", config.num_heads), ("o_groups", config.o_groups),
                        ("n_routed_experts", config.num_experts)):
            if n % self.tp.size:
                raise ValueError(f"tensor-parallel size {self.tp.size} must divide {what}={n}")
        self.model = DeepseekV4Model(config, self.tp)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, seqs: list[SeqSlice]) -> torch.Tensor:
        """input_ids [T]: every sequence's new nodes laid end to end (rows ``seqs[i].start ..``)."""
        cfg = self.config
        positions = torch.cat([s.plan.positions for s in seqs])  # [T]
        x = self.model.embed_tokens(input_ids)  # [T, H]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, hc, H]
        tables = {"main": rope_cos_sin(cfg.rope_main, positions, x.dtype),
                  "compress": rope_cos_sin(cfg.rope_compress, positions, x.dtype)}
        for layer in self.model.layers:
            attn: DeepseekV4Attention = layer.self_attn
            cos, sin = tables["main" if attn.rope is cfg.rope_main else "compress"]
            streams = layer(streams, input_ids, cos, sin, seqs)
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def run(self, requests: list[tuple[SeqState, TreePlan, list[int]]]) -> tuple[torch.Tensor,
                                                                                list[list[LayerScratch]]]:
        """One forward over several sequences: (state, plan, node tokens) each -> logits of every node [T, V]
        and each sequence's scratch (per layer), ready for ``compressed_state.commit``."""
        seqs, ids, start = [], [], 0
        for state, plan, tokens in requests:
            if len(tokens) != plan.num_nodes:
                raise ValueError(f"{len(tokens)} tokens for a plan of {plan.num_nodes} nodes")
            seqs.append(SeqSlice(start, plan, state.layers, []))
            ids += tokens
            start += len(tokens)
        device = self.lm_head.weight.device
        hidden = self.forward(torch.tensor(ids, dtype=torch.long, device=device), seqs)
        return self.compute_logits(hidden), [s.scratch for s in seqs]

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy (name, tensor or slice) pairs, in transformers' names or the checkpoint's own (DeepSeek's,
        with one tensor per expert); every parameter and routing table must be covered."""
        targets = dict(self.named_parameters())
        targets.update(dict(self.named_buffers()))
        loaded: set[str] = set()
        inter = self.config.moe_intermediate_size
        for raw, src in weights:
            name, expert, part = canonical_weight_name(raw)
            if name.startswith("mtp.") or ".mtp." in name:
                continue  # the multi-token-prediction head is not used
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in targets:
                raise KeyError(f"checkpoint tensor {raw!r} has no matching parameter in DeepseekV4ForCausalLM")
            dst = targets[name]
            tensor = read_full(src)
            if expert is not None:  # one expert's w1 / w3 (halves of gate_up_proj) or w2 (down_proj)
                local = expert - self.tp.rank * dst.shape[0]
                if not 0 <= local < dst.shape[0]:
                    loaded.add(f"{name}:{expert}:{part}")  # another rank's expert
                    continue
                dst = dst[local]
                if part is not None:
                    dst = dst[part * inter:(part + 1) * inter]
            else:
                tensor = self._shard(name, tensor)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"shape mismatch loading {raw}: expected {tuple(dst.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            forget_packed(dst)
            loaded.add(name if expert is None else f"{name}:{expert}:{part}")
        expected = set()
        for name in targets:  # (per-expert names count every expert, this rank's or not)
            if name.endswith("experts.gate_up_proj") and f"{name}" not in loaded:
                expected.update(f"{name}:{e}:{h}" for e in range(self.config.num_experts) for h in (0, 1))
            elif name.endswith("experts.down_proj") and name not in loaded:
                expected.update(f"{name}:{e}:None" for e in range(self.config.num_experts))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights for: {shown}")

    def _shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor: query heads (q_b_proj rows, sinks), output groups (o_a_proj rows,
        o_b_proj columns), experts (merged tensors). Everything else is replicated."""
        r, n = self.tp.rank, self.tp.size
        if n == 1:
            return full
        if name.endswith((".self_attn.q_b_proj.weight", ".self_attn.sinks", ".self_attn.o_a_proj.weight",
                          ".experts.gate_up_proj", ".experts.down_proj")):
            return full.chunk(n, dim=0)[r]
        if name.endswith(".self_attn.o_b_proj.weight"):
            return full.chunk(n, dim=1)[r]
        return full


# DeepSeek's checkpoint names -> ours (= transformers'), applied in order; each is a no-op on our names.
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def canonical_weight_name(name: str) -> tuple[str, int | None, int | None]:
    """(our parameter name, expert index or None, half of gate_up_proj: 0 gate / 1 up / None)."""
    name = name.removeprefix("model.")
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    expert = None
    part: int | None = None
    m = _EXPERT.match(name)
    if m:
        base, expert, w = m.group(1), int(m.group(2)), m.group(3)
        name, part = (f"{base}.down_proj", None) if w == "w2" else (f"{base}.gate_up_proj", 0 if w == "w1" else 1)
    return (name if name.startswith("lm_head.") else f"model.{name}"), expert, part

def load_deepseek_v4(path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                     tp: TPGroup | None = None) -> DeepseekV4ForCausalLM:
    """A V4 checkpoint directory (config.json + safetensors, transformers' names) -> our model."""
    from transformers import AutoConfig

    from workers.weight_files import iter_weights

    path = os.fspath(path)
    cfg = DeepseekV4ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, tp)
    model.load_weights(iter_weights(path))
    return model.eval()
