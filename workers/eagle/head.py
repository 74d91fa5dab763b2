"""An EAGLE head as a one-layer draft model: the runner's interface, plus the target's features per row.

The draft worker runs it through the ordinary ``ModelRunner`` (its own paged KV cache for its one layer, the same
scratch / commit rules as a draft model's). What a draft model does not have, the features, the worker sets on
the head before each forward (``features``: one row per new token, already fused to ``hidden_size``), and reads
back after it (``prenorm``: each row's output before the final norm, the feature its children are drafted from).

Row j of the head is token x_j with the feature of position j - 1 (the target's hidden state that predicted x_j,
or for a drafted node the head's own output at its parent), and predicts x_{j+1}: the pairing of vLLM and the
EAGLE papers, with RoPE position j instead of j - 1 (attention depends on position differences only).

Weights: the published layout (``fc``, ``midlayer.*`` or ``layers.0.*``, ``norm``, optional ``embed_tokens``,
``lm_head``, ``d2t``; ``t2d`` is not needed), safetensors only. A head without ``embed_tokens`` / ``lm_head``
uses the target's, read from the target checkpoint (safetensors or GGUF).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionContext
from workers.eagle.head_config import EAGLE3, EagleHeadConfig
from workers.gguf_loader import is_gguf, iter_gguf_weights
from workers.kernels.row_linear import forget_packed
from workers.layers import RMSNorm, RotaryEmbedding, WeightSource, apply_rotary, read_full
from workers.model_config import ModelConfig
from workers.weight_files import iter_weights


class _Attention(nn.Module):
    def __init__(self, c: EagleHeadConfig, in_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.c = c
        d = c.head_dim
        self.q_proj = nn.Linear(in_size, c.num_heads * d, bias=c.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(in_size, c.num_kv_heads * d, bias=c.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(in_size, c.num_kv_heads * d, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=c.attention_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t, d = x.shape[0], self.c.head_dim
        q = apply_rotary(self.q_proj(x).view(t, self.c.num_heads, d), cos, sin)  # [T, Hq, D]
        k = apply_rotary(self.k_proj(x).view(t, self.c.num_kv_heads, d), cos, sin)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.c.num_kv_heads, d)
        return self.o_proj(ctx.attend(0, q, k, v).reshape(t, self.c.num_heads * d))  # [T, H]


class _MLP(nn.Module):
    def __init__(self, c: EagleHeadConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: EagleHeadConfig, dtype: torch.dtype) -> None:
        super().__init__()
        eagle3 = c.kind == EAGLE3
        self.self_attn = _Attention(c, 2 * c.hidden_size if eagle3 else c.hidden_size, dtype)
        self.mlp = _MLP(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if eagle3:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)


class EagleHead(nn.Module):
    """The runner's model interface (``forward`` -> hidden rows, ``compute_logits`` -> full-vocabulary logits)."""

    def __init__(self, c: EagleHeadConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.head_config = c
        self.dtype = dtype  # the compute dtype (its matrices may be held as blocks: workers/q8_weights.py)
        self.eagle3 = c.kind == EAGLE3
        h = c.hidden_size
        fc_in = c.feature_size if self.eagle3 else 2 * h
        self.fc = nn.Linear(fc_in, h, bias=not self.eagle3, dtype=dtype)  # EAGLE-1's fc has a bias
        self.layers = nn.ModuleList([_Layer(c, dtype)])
        self.norm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.embed_tokens = nn.Embedding(c.vocab_size, h, dtype=dtype)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        # target id of each lm_head row (d2t offsets added); None: the rows are the target's ids
        self.register_buffer("draft_ids", None if c.draft_vocab_size == c.vocab_size else
                             torch.arange(c.draft_vocab_size), persistent=False)
        self.features: torch.Tensor | None = None  # [T, H]: set by the worker before each forward
        self.prenorm: torch.Tensor | None = None  # [T, H]: each row's output before the final norm
        self.row_invariant = False  # read by the runner

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features [N, feature_size] as the head's hidden input [N, H] (eagle3: through ``fc``;
        EAGLE-1 applies its fc to [embed; feature] inside the forward)."""
        return self.fc(aux.to(self.dtype)) if self.eagle3 else aux.to(self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        feats = self.features  # [T, H]
        if feats is None or feats.shape[0] != input_ids.shape[0]:
            raise RuntimeError("EagleHead.forward needs one feature row per token (set .features first)")
        layer = self.layers[0]
        emb = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary_emb(positions)
        if self.eagle3:
            if self.head_config.norm_before_residual:
                feats = layer.hidden_norm(feats)
                x = torch.cat([layer.input_layernorm(emb), feats], dim=-1)  # [T, 2H]
            else:
                x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(feats)], dim=-1)  # [T, 2H]
            h = feats + layer.self_attn(x, cos, sin, ctx)
        else:
            x = self.fc(torch.cat([emb, feats], dim=-1))  # [T, H]
            h = x + layer.self_attn(x, cos, sin, ctx)
        h = h + layer.mlp(layer.post_attention_layernorm(h))  # [T, H]
        self.prenorm = h
        return self.norm(h) if self.eagle3 else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 over the target's vocabulary (-inf at ids a trimmed head cannot propose)."""
        logits = self.lm_head(hidden).float()  # [N, Vd]
        if self.draft_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.head_config.vocab_size), float("-inf"))  # [N, V]
        full[:, self.draft_ids] = logits
        return full

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]],
                     target: Iterable[tuple[str, WeightSource]] | None = None) -> None:
        """The head's tensors; ``target``: the target's, for an embedding / lm_head the head does not carry."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw_name, src in weights:
            name = raw_name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d":
                continue
            if name == "d2t":
                offsets = read_full(src).long()  # [Vd]: target id = row + d2t[row]
                self.draft_ids = torch.arange(offsets.shape[0], device=offsets.device) + offsets
                continue
            if name not in params:
                raise KeyError(f"EAGLE head tensor {raw_name!r} has no matching parameter")
            _copy(params[name], src, raw_name)
            loaded.add(name)
        if self.head_config.draft_vocab_size != self.head_config.vocab_size and "lm_head.weight" in loaded:
            if self.draft_ids is None or self.draft_ids.shape[0] != self.head_config.draft_vocab_size:
                raise ValueError("a head with a trimmed lm_head needs a d2t map of draft_vocab_size entries")
        missing = {"embed_tokens.weight", "lm_head.weight"} - loaded
        if missing and target is not None:
            found: dict[str, WeightSource] = {}
            for name, src in target:
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    found[name.removeprefix("model.")] = read_full(src).clone()
            if "lm_head.weight" not in found and "embed_tokens.weight" in found:
                found["lm_head.weight"] = found["embed_tokens.weight"]  # a tied target
            for name in sorted(missing):
                if name in found:
                    _copy(params[name], found[name], f"target's {name}")
                    loaded.add(name)
        left = sorted(set(params) - loaded)
        if left:
            raise ValueError(f"EAGLE head: no weights for {left} (in the head or its target)")


def _copy(param: nn.Parameter, src: WeightSource, what: str) -> None:
    t = read_full(src)
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"EAGLE head: {what} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(t.to(param.dtype))
        forget_packed(param)


def target_weights(target_path: str, target_config: ModelConfig) -> Iterable[tuple[str, WeightSource]]:
    """The target checkpoint's tensors (lazy), for the embedding and head a head may share with it."""
    if is_gguf(target_path):
        return iter_gguf_weights(target_path, target_config)
    return iter_weights(target_path)


def load_head(path: str, target_path: str | None, target_config: ModelConfig | None,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> EagleHead:
    """The head in ``path``, its missing embedding / lm_head taken from the target; checks it fits the target."""
    c = EagleHeadConfig.from_pretrained(path)
    if target_config is not None:
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(f"EAGLE head {path!r}: vocab_size {c.vocab_size}, the target has "
                             f"{target_config.vocab_size} (a head serves the target it was trained on)")
        if c.target_hidden_size != target_config.hidden_size:
            raise ValueError(f"EAGLE head {path!r}: target_hidden_size {c.target_hidden_size}, the target's hidden "
                             f"size is {target_config.hidden_size}")
    with torch.device(device):
        head = EagleHead(c, dtype)
    target = target_weights(target_path, target_config) if target_path and target_config else None
    head.load_weights(iter_weights(os.fspath(path)), target)
    return head.to(device).eval()
