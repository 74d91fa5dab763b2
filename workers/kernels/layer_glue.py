"""A Llama decoder layer on GGUF block weights as three calls: ``front``, the attention, ``back``
(layer_glue.cpp, built into the block kernel's library: workers/kernels/gguf_blocks.py).

A one-row decode step of the 4-bit SmolLM2 spent about as much CPU on ~40 small torch ops a layer (norms,
residual adds, RoPE, silu * up, views, casts, module calls) as on its matmuls; here a layer is

    front: hidden += delta; qkv = rms_norm(hidden) Wqkv^T; RoPE on q, k         (one native call)
    attention on views of qkv                                                  (the caller's ``AttentionContext``)
    back:  hidden += attn Wo^T; delta = mlp(rms_norm(hidden))                   (one native call)

``glued_layers(layers)`` builds this per model (never per batch) when every layer fits: the native kernel in use,
its four linear layers held as ``BlockLinear`` without bias, one tensor-parallel rank, float32 norms, no per-head
q/k norm; and not ``SPECSERVE_LAYER_GLUE=0``. Otherwise None, and the model keeps its torch path.

Each row is computed alone in a fixed order (layer_glue.cpp), so rows stay bit-identical whatever shares the
batch. Against the torch path: residual adds and RoPE are torch's bits; RMSNorm sums its squares in another fixed
order and silu uses the C library's exp, so values can differ in the last bit (tests/test_layer_glue.py shows
both against torch, and greedy text unchanged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from workers.kernels import gguf_blocks

ISA = {"auto": 0, "skewed": gguf_blocks.ISA["skewed"]}  # the glue ops' variants ("skewed": tests only)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 isa: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [M, K] (+ delta [M, K]) -> (the sum, rms_norm(sum) * weight), float32, each row alone."""
    return torch.ops.specserve_gguf.add_rms_norm(hidden, delta, weight, eps, ISA[isa])


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """x [M, >= heads * D] (unit column stride): its first ``heads`` heads rotated in place by cos / signed sin
    [M, 1, D] (``workers.layers.RotaryEmbedding``); returns x."""
    return torch.ops.specserve_gguf.rope_(x, cos, sin, heads, head_dim)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate | up) -> silu(gate) * up [M, I]."""
    return torch.ops.specserve_gguf.silu_mul(x)


def add_rms_norm_reference(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``add_rms_norm`` computes, by torch ops (workers/layers.py's RMSNorm)."""
    total = hidden if delta is None else hidden + delta
    return total, torch.nn.functional.rms_norm(total, weight.shape, weight, eps)


@dataclass(frozen=True)
class _Matmul:
    weight: torch.Tensor  # the BlockLinear's held blocks
    qtype: int
    n: int  # output columns for 8-bit activations; -1: float32 activations (the file's blocks)
    isa: int  # the block kernel's instruction set for it

    @staticmethod
    def of(layer: nn.Module) -> _Matmul:
        quant = layer.quant
        if quant.activations == "q8":
            isa = gguf_blocks.ISA["avx512vnni" if gguf_blocks.best_isa() == "avx512vnni" else "scalar"]
            return _Matmul(quant.blocks, quant.qtype, quant.out_features, isa)
        return _Matmul(quant.blocks, quant.qtype, -1, -1)


class GluedLayer:
    """One decoder layer's weights as the native calls take them (read-only views of the layer's own tensors)."""

    def __init__(self, layer: nn.Module, isa: str = "auto") -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o = _Matmul.of(attn.qkv_proj), _Matmul.of(attn.o_proj)
        self.gate_up, self.down = _Matmul.of(mlp.gate_up_proj), _Matmul.of(mlp.down_proj)
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.rot_heads = attn.num_heads + attn.num_kv_heads  # q and k heads are adjacent columns of qkv
        self.head_dim = attn.head_dim
        self.isa = ISA[isa]
        if self.qkv.n >= 0 and self.o.n < 0:
            raise ValueError("a layer's matmuls must share one activation mode")

    def front(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, H] + delta, qkv [T, (Hq + 2 Hkv) D] with q and k rotated)."""
        q = self.qkv
        return torch.ops.specserve_gguf.layer_front(hidden, delta, self.norm1, self.eps1, q.weight, q.qtype, q.n,
                                                    q.isa, cos, sin, self.rot_heads, self.head_dim, self.isa)

    def back(self, hidden: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], the attention's output [T, Hq D] -> (hidden + attn Wo^T, the MLP's output) [T, H] x 2."""
        o, gu, d = self.o, self.gate_up, self.down
        return torch.ops.specserve_gguf.layer_back(hidden, attn, o.weight, o.qtype, o.n, self.norm2, self.eps2,
                                                   gu.weight, gu.qtype, gu.n, d.weight, d.qtype, d.n, o.isa, self.isa)


def _switched_on() -> bool:
    return os.environ.get("SPECSERVE_LAYER_GLUE", "1") != "0"


def _fits(layer: nn.Module) -> bool:
    from workers.quantized_linear import BlockLinear

    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (all(isinstance(m.quant, BlockLinear) and m.bias is None and m.tp.size == 1 for m in linears)
            and len({m.quant.activations for m in linears}) == 1
            and all(n.weight.dtype == torch.float32 and n.weight.device.type == "cpu" for n in norms)
            and attn.q_norm is None)


def glued_layers(layers: nn.ModuleList) -> list[GluedLayer] | None:
    """Every layer as a ``GluedLayer``, or None when one does not fit (the model then keeps its torch path)."""
    if not _switched_on() or len(layers) == 0 or not all(_fits(layer) for layer in layers):
        return None
    return [GluedLayer(layer) for layer in layers]
