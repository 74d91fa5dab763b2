"""DeepSeek-V4's hyper-parameters, read once from a transformers ``DeepseekV4Config``.

Kept apart from ``workers.model_config.ModelConfig`` because almost nothing of V4 fits the Llama-shaped fields:
one shared K=V head with partial RoPE, two RoPE tables ("main" for sliding-only layers, "compress" for CSA/HCA
layers and their compressors), per-layer attention kinds and MoE kinds, hyper-connections.

The RoPE inverse frequencies are computed here through transformers' own RoPE init functions (so YaRN and
friends mean exactly what the checkpoint's config says) and stored as plain tuples: the model never needs
transformers at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
MLP_KINDS = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class RopeTable:
    inv_freq: tuple[float, ...]  # one theta per rotated channel pair (interleaved layout)
    scaling: float  # cos/sin multiplier (1.0 except some YaRN variants)

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True)
class DeepseekV4ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_kinds: tuple[str, ...]  # per layer, one of LAYER_KINDS
    mlp_kinds: tuple[str, ...]  # per layer, one of MLP_KINDS
    csa_ratio: int  # m: tokens per CSA summary (windows of 2m, stride m)
    hca_ratio: int  # m': tokens per HCA summary (non-overlapping)
    sliding_window: int  # W: raw keys a query sees (itself included)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeTable
    rope_compress: RopeTable
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    architecture: str = "DeepseekV4ForCausalLM"
    model_type: str = "deepseek_v4"

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != self.num_layers or len(self.mlp_kinds) != self.num_layers:
            raise ValueError(f"layer_types / mlp_layer_types must have num_hidden_layers={self.num_layers} entries")
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS] + [k for k in self.mlp_kinds if k not in MLP_KINDS]
        if bad:
            raise ValueError(f"unknown DeepSeek-V4 layer kinds {bad}; expected {LAYER_KINDS} / {MLP_KINDS}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r}; supported: {SCORING_FUNCS}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide num_heads * head_dim")
        for table in (self.rope_main, self.rope_compress):
            if table.rope_dim > self.head_dim:
                raise ValueError(f"rotary dim {table.rope_dim} exceeds head_dim {self.head_dim}")
        if CSA in self.layer_kinds and self.rope_compress.rope_dim > self.index_head_dim:
            raise ValueError(f"rotary dim {self.rope_compress.rope_dim} exceeds index_head_dim {self.index_head_dim}")
        if min(self.csa_ratio, self.hca_ratio, self.sliding_window) < 1:
            raise ValueError("compress rates and sliding_window must be >= 1")

    def ratio(self, layer: int) -> int:
        """Tokens per summary of ``layer``'s compressor (0: sliding-window only)."""
        kind = self.layer_kinds[layer]
        return self.csa_ratio if kind == CSA else self.hca_ratio if kind == HCA else 0

    @staticmethod
    def from_hf(hf: Any, eos_token_ids: tuple[int, ...] = ()) -> DeepseekV4ModelConfig:
        """From a transformers ``DeepseekV4Config`` (already normalised by its ``__post_init__``)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # heavy import, only when reading one

        def table(label: str) -> RopeTable:
            params = hf.rope_parameters[label]
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                dim = int(hf.head_dim * params.get("partial_rotary_factor", 1.0))
                inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                return RopeTable(tuple(inv.tolist()), 1.0)
            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, None, layer_type=label)
            return RopeTable(tuple(inv.tolist()), float(scale))

        rates = hf.compress_rates
        archs = getattr(hf, "architectures", None) or ["DeepseekV4ForCausalLM"]
        eos = getattr(hf, "eos_token_id", None)
        if not eos_token_ids and eos is not None:
            eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        from workers.model_config import parse_dtype

        return DeepseekV4ModelConfig(
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads, head_dim=hf.head_dim, q_lora_rank=hf.q_lora_rank,
            o_groups=hf.o_groups, o_lora_rank=hf.o_lora_rank,
            layer_kinds=tuple(hf.layer_types), mlp_kinds=tuple(hf.mlp_layer_types),
            csa_ratio=int(rates[CSA]), hca_ratio=int(rates[HCA]), sliding_window=hf.sliding_window,
            index_n_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim, index_topk=hf.index_topk,
            num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size, n_shared_experts=hf.n_shared_experts,
            scoring_func=hf.scoring_func, routed_scaling_factor=float(hf.routed_scaling_factor),
            swiglu_limit=float(hf.swiglu_limit), hc_mult=hf.hc_mult, hc_sinkhorn_iters=hf.hc_sinkhorn_iters,
            hc_eps=float(hf.hc_eps), rms_norm_eps=float(hf.rms_norm_eps),
            rope_main=table("main"), rope_compress=table("compress"),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids,
            dtype=parse_dtype(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)),
            architecture=archs[0],
        )
