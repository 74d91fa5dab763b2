"""Llama-style decoder (Llama 2/3, Mistral, Qwen2, Qwen3), tensor-parallel through ``workers.layers``.

The families differ only in flags that ``ModelConfig`` reads from config.json: q/k/v (and o) bias, Qwen3's
per-head q/k RMSNorm, RoPE scaling, tied embeddings. Attention itself is delegated to the
``AttentionContext`` the runner builds for each forward, so this file knows nothing about caches or trees.

Our parameter names are Hugging Face's except for two merges: ``self_attn.qkv_proj`` (q_proj, k_proj, v_proj)
and ``mlp.gate_up_proj`` (gate_proj, up_proj); ``load_weights`` takes the HF names and routes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workers.attention import AttentionContext
from workers.distributed import TPGroup
from workers.kernels.layer_glue import GluedLayer, add_rms_norm, glued_layers
from workers.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSource,
    apply_rotary,
    silu_and_mul,
)
from workers.model_config import ModelConfig

# HF name fragment -> (our module name fragment, shard id passed to that module's weight_loader)
_MERGED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
# Checkpoint entries that carry no weights we use (old checkpoints saved RoPE tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.attention_bias, tp, config.dtype)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        config.o_proj_bias, tp, config.dtype)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) / tp * D]
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv / tp, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :qk_size].split([self.qkv_proj.q_size, self.qkv_proj.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))  # [T, Hq / tp, D]
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))  # [T, Hkv / tp, D]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            # q and k heads are adjacent columns: rotate them in one call (same arithmetic, half the op count).
            qk = apply_rotary(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = ctx.attend(self.layer_idx, q, k, v)  # [T, Hq / tp, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))  # [T, H]

    def attend_qkv(self, qkv: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Attention on qkv [T, (Hq + 2 Hkv) D] whose q and k are already rotated -> [T, Hq D] (the glued path)."""
        t, q_size = qkv.shape[0], self.qkv_proj.q_size
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = qkv[:, q_size:q_size + self.qkv_proj.kv_size].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = qkv[:, q_size + self.qkv_proj.kv_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        return ctx.attend(self.layer_idx, q, k, v).reshape(t, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       config.mlp_bias, tp, config.dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp,
                                           config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.glued: GluedLayer | None = None  # this layer as native calls (``LlamaModel.set_glue``)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        if self.glued is not None:  # the bits of LlamaModel's glued loop, which adds the MLP's output later
            hidden, qkv = self.glued.front(hidden, None, cos, sin)
            hidden, mlp_out = self.glued.back(hidden, self.self_attn.attend_qkv(qkv, ctx))
            return hidden + mlp_out
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, config.dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # EAGLE heads read some layers' input hidden states (-1: the normed output), captured in every forward
        # as ``aux_hidden`` [T, len(aux_layers) * H] (workers/eagle/features.py); empty: nothing is kept.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # The layers as a few native calls each (workers/kernels/layer_glue.py), or None: the torch path.
        self.glue: list[GluedLayer] | None = None

    def set_glue(self, on: bool = True) -> bool:
        """Run the layers and the final norm as native calls (``on``, where every layer fits: GGUF block weights on
        the native kernel; the loader asks once per model) or as torch ops; returns whether they now are glued.
        Every path through the layers (this forward, ``layer(...)`` one at a time, ``self.norm``) then computes
        the same bits, so a forward cut in pieces (workers/layer_skip/) equals the whole."""
        self.glue = glued_layers(self.layers) if on else None
        for i, layer in enumerate(self.layers):
            layer.glued = self.glue[i] if self.glue else None
        self.norm.native = self.glue is not None
        return self.glue is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb(positions)  # [T, 1, D] each, once for all layers
        if self.glue is not None:
            return self._forward_glued(self.glue, hidden, cos, sin, ctx)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = hidden
            hidden = layer(hidden, cos, sin, ctx)
        out = self.norm(hidden)
        if self.aux_layers:
            aux[-1] = out
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        return out


    def _forward_glued(self, glued: list[GluedLayer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx: AttentionContext) -> torch.Tensor:
        """The same layers as ``forward``'s loop, each as front, attention, back; the MLP's output is added to the
        residual stream by the next call (the next front, or the final norm)."""
        delta: torch.Tensor | None = None  # [T, H], not yet added to hidden
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, g) in enumerate(zip(self.layers, glued, strict=True)):
            if i in self.aux_layers:
                hidden, delta = (hidden, None) if delta is None else (hidden + delta, None)
                aux[i] = hidden
            hidden, qkv = g.front(hidden, delta, cos, sin)  # [T, H], [T, (Hq + 2 Hkv) D]
            hidden, delta = g.back(hidden, layer.self_attn.attend_qkv(qkv, ctx))
        out = add_rms_norm(hidden, delta, self.norm.weight, self.norm.eps)[1]  # [T, H]
        if self.aux_layers:
            aux[-1] = out
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        return out


class LlamaForCausalLM(nn.Module):
    """The model-runner interface: ``forward`` -> final hidden states, ``compute_logits`` -> full-vocab logits."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single()
        config.check_tp(self.tp.size)
        self.model = LlamaModel(config, self.tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp, config.dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # same sharding, so one tensor serves both
        # A row's logits independent of the other rows of the forward (head and attention; workers/row_invariant.py).
        # The loader sets it for quantized models, whose bfloat16 activations make 1e-7 differences flip tokens.
        self.row_invariant = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] long (a flattened batch) -> hidden states after the final norm [T, H]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 over the whole vocabulary (identical on every TP rank)."""
        return self.lm_head.logits(hidden, row_invariant=self.row_invariant)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Load (HF name, tensor or safetensors slice) pairs; every parameter must be covered exactly."""
        params = dict(self.named_parameters())  # a tied head appears once, as model.embed_tokens.weight
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for hf_name, src in weights:
            routed = self.route_weight(hf_name)
            if routed is None:
                continue
            name, shard_id = routed
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter in "
                               f"{type(self).__name__} ({self.config.architecture})")
            module_name, _, _ = name.rpartition(".")
            modules[module_name].weight_loader(params[name], src, shard_id)
            loaded.add(name if shard_id is None else f"{name}:{shard_id}")
        self._check_complete(params, loaded)

    def route_weight(self, hf_name: str) -> tuple[str, Any] | None:
        """(our parameter name, shard id for its module's weight_loader) of an HF tensor; None: not used."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints also store the head; the embedding is the source of truth
        for hf_part, (ours, sid) in _MERGED.items():
            if hf_part in hf_name:
                return hf_name.replace(hf_part, ours), sid
        return hf_name, None

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        expected: set[str] = set()
        for name in params:
            if ".qkv_proj." in name:
                expected.update(f"{name}:{s}" for s in ("q", "k", "v"))
            elif ".gate_up_proj." in name:
                expected.update(f"{name}:{s}" for s in (0, 1))
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights for: {shown}")
