"""Writing an EAGLE head in the published layout (what vLLM and SGLang load, and what workers/eagle/head.py reads).

    config.json        {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": ..., "draft_vocab_size": ...,
                        "target_hidden_size": ..., "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]}}
    model.safetensors  fc.weight, midlayer.{self_attn,mlp,*norm}.*, norm.weight, lm_head.weight, d2t, t2d
                       (no embed_tokens: the target's embedding is used; saves vocab x hidden floats)

``d2t[r]`` is the offset from draft row r to its target id (target id = r + d2t[r]); ``t2d`` marks the target ids
the draft vocabulary covers.
"""

from __future__ import annotations

import json
import os

import torch

from workers.eagle.head import EagleHead
from workers.eagle.head_config import EAGLE3, EagleHeadConfig
from workers.model_config import ModelConfig

ARCHITECTURES = {EAGLE3: "LlamaForCausalLMEagle3", "eagle": "EagleLlamaForCausalLM"}


def head_config_dict(target: ModelConfig, kind: str = EAGLE3, aux_layer_ids: list[int] | None = None,
                     draft_vocab_size: int | None = None, intermediate_size: int | None = None) -> dict:
    """A head config for ``target``: the target's width, heads and RoPE; one layer."""
    d = {
        "architectures": [ARCHITECTURES[kind]], "model_type": "llama", "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim, "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_model_len, "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size or target.vocab_size, "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if target.rope_scaling:
        d["rope_scaling"] = dict(target.rope_scaling)
    if kind == EAGLE3:
        d["eagle_config"] = {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids or
                                                                      EagleHeadConfig.from_dict(d).aux_layers(
                                                                          target.num_layers))}
    return d


def save_head(path: str | os.PathLike[str], config: dict, head: EagleHead, draft_ids: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32) -> str:
    """Write ``head``'s weights (all but the embedding, which the target supplies) under published names."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in head.state_dict().items():
        if name.startswith("embed_tokens.") or name == "draft_ids":
            continue
        tensors[name.replace("layers.0.", "midlayer.")] = p.detach().to(dtype).contiguous().cpu()
    if draft_ids is not None:
        ids = draft_ids.long().cpu()
        tensors["d2t"] = ids - torch.arange(ids.shape[0])
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
    return path


@torch.no_grad()
def random_head(path: str | os.PathLike[str], target: ModelConfig, kind: str = EAGLE3, seed: int = 0,
                draft_ids: list[int] | None = None) -> str:
    """A head with random weights at a scale that gives O(1) logits (tests; and training's starting point)."""
    config = head_config_dict(target, kind, draft_vocab_size=len(draft_ids) if draft_ids else None)
    head = EagleHead(EagleHeadConfig.from_dict(config))
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(head.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else
                0.1 * noise if p.dim() == 1 else noise / p.shape[-1] ** 0.5)
    return save_head(path, config, head, torch.tensor(draft_ids) if draft_ids else None)
