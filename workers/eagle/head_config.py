"""What an EAGLE head's config.json says, read the way vLLM and SGLang read the published checkpoints.

Two kinds, told apart by the architecture name:

- **eagle3** (``LlamaForCausalLMEagle3``, ``Eagle3LlamaForCausalLM``, ...): ``fc`` fuses three of the target's
  hidden states (low, middle, high layer: ``eagle_config.eagle_aux_hidden_state_layer_ids``, default
  (2, L // 2, L - 3) as vLLM picks them) into one; the decoder layer attends over [embed; hidden] (2 x hidden);
  ``lm_head`` may cover a trimmed draft vocabulary (``draft_vocab_size`` rows, ``d2t`` offsets to target ids).
- **eagle** (EAGLE-1, ``EagleLlamaForCausalLM``, ``LlamaForCausalLMEagle``): ``fc`` maps [embed; the target's
  last hidden state] to hidden; the layer has no input norm; its output feeds the target's head as it is.

Read with ``json`` rather than transformers: the head's architecture is not a transformers class.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from workers.model_config import _rope_params

EAGLE3 = "eagle3"
EAGLE = "eagle"
FINAL_NORM = -1  # aux layer id standing for the target's output after its final norm (EAGLE-1's feature)


def head_kind(architecture: str) -> str | None:
    """"eagle3", "eagle", or None for an architecture name that is not an EAGLE head."""
    name = architecture.lower()
    if "eagle3" in name:
        return EAGLE3
    return EAGLE if "eagle" in name else None


def is_eagle_head(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory whose config.json names an EAGLE head architecture."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        archs = json.load(f).get("architectures") or []
    return any(head_kind(a) for a in archs)


@dataclass(frozen=True)
class EagleHeadConfig:
    kind: str  # EAGLE3 or EAGLE
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    vocab_size: int  # the target's vocabulary (embedding rows, and the ids logits are returned over)
    draft_vocab_size: int  # rows of the head's lm_head (== vocab_size unless trimmed)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth (``aux_layers``)
    norm_before_residual: bool  # eagle3 variant: the residual is the normed hidden state
    attention_bias: bool
    mlp_bias: bool
    max_model_len: int

    @staticmethod
    def from_pretrained(path: str) -> EagleHeadConfig:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"EAGLE head {path!r} has no config.json")
        with open(file) as f:
            raw: dict[str, Any] = json.load(f)
        return EagleHeadConfig.from_dict(raw, path)

    @staticmethod
    def from_dict(raw: dict[str, Any], where: str = "config") -> EagleHeadConfig:
        archs = raw.get("architectures") or []
        kinds = [head_kind(a) for a in archs if head_kind(a)]
        if not kinds:
            raise ValueError(f"{where}: architectures {archs} name no EAGLE head (expected e.g. "
                             "'LlamaForCausalLMEagle3' or 'EagleLlamaForCausalLM')")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eagle_cfg = raw.get("eagle_config") or {}
        if eagle_cfg.get("use_aux_hidden_state") is False:
            kinds = [EAGLE]  # an eagle3-named head fed the last hidden state only (vLLM's switch)
        aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        theta, scaling = _rope_params(SimpleNamespace(max_position_embeddings=raw.get("max_position_embeddings"),
                                                      **{k: v for k, v in raw.items()
                                                         if k in ("rope_parameters", "rope_scaling", "rope_theta")}))
        vocab = int(raw["vocab_size"])
        return EagleHeadConfig(
            kind=kinds[0], hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
            max_model_len=int(raw.get("max_position_embeddings") or 2048))

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input hidden states feed the head (FINAL_NORM: the target's normed output)."""
        if self.kind == EAGLE:
            return (FINAL_NORM,)
        ids = self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)
        ids = tuple(min(max(i, 0), target_layers - 1) for i in ids)  # a shallow target clamps vLLM's defaults
        if len(ids) != 3:
            raise ValueError(f"an EAGLE-3 head fuses 3 hidden states, its config lists {len(ids)}: {list(ids)}")
        return ids

    @property
    def feature_size(self) -> int:
        """Width of the target features one row of the head reads (before ``fc`` for eagle3)."""
        return self.target_hidden_size * (3 if self.kind == EAGLE3 else 1)
