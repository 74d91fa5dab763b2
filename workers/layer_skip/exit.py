"""The exit of an early-exit draft: layer L's hidden state -> logits over the target's vocabulary.

Two kinds, both ending in the target's own final norm and head (no second vocabulary projection to ship):

- adapter-free: the final norm and head read layer L's hidden state directly: for checkpoints trained for early
  exit (LayerSkip's layer dropout + early-exit loss); a model not trained that way exits poorly;
- an exit adapter (Kangaroo-style, shallow): a residual MLP block on layer L's hidden state first, trained on a
  frozen target to match its next-token law (training/exit_adapter.py). Kangaroo's adapter has an attention layer;
  this one is position-local (no KV of its own to keep, roll back or reuse), which costs some acceptance.

An adapter directory holds ``config.json`` (``ExitAdapterConfig``: its L, the target it was trained for) and
``model.safetensors``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.layers import RMSNorm

ADAPTER_ARCH = "SpecserveExitAdapter"


@dataclass(frozen=True)
class ExitAdapterConfig:
    exit_layer: int  # L: the adapter reads the input of layer L (after L decoder layers)
    target: str  # the name of the target it was trained for (target_name(); a mismatch is refused)
    hidden_size: int  # the target's
    adapter_size: int  # the MLP's inner width: acceptance vs the exit's cost per drafted token
    num_layers: int  # the target's, so an adapter is not loaded on a deeper or shallower model of the same name
    rms_norm_eps: float = 1e-5
    architecture: str = ADAPTER_ARCH

    @classmethod
    def from_pretrained(cls, path: str) -> ExitAdapterConfig:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ValueError(f"speculative_config.model {path!r}: not an exit adapter directory (no config.json)")
        with open(file) as f:
            raw = json.load(f)
        if raw.get("architecture") != ADAPTER_ARCH:
            raise ValueError(f"speculative_config.model {path!r}: config.json is not an exit adapter's "
                             f"(architecture {raw.get('architecture')!r}, expected {ADAPTER_ARCH!r})")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(asdict(self), f, indent=2)


def target_name(target_path: str) -> str:
    """What an adapter names its target by: the checkpoint directory's (or GGUF file's) base name."""
    return os.path.basename(os.path.normpath(target_path))


class ExitAdapter(nn.Module):
    """h + W_down silu(W_up norm(h)): [T, H] -> [T, H], before the target's final norm and head."""

    def __init__(self, c: ExitAdapterConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = c
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.up = nn.Linear(c.hidden_size, c.adapter_size, bias=False, dtype=dtype)
        self.down = nn.Linear(c.adapter_size, c.hidden_size, bias=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(self.up.weight.dtype)
        return (x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))).to(hidden.dtype)

    def save(self, path: str) -> None:
        self.config.save(path)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()},
                  os.path.join(path, "model.safetensors"))


def load_adapter(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ExitAdapter:
    c = ExitAdapterConfig.from_pretrained(path)
    adapter = ExitAdapter(c, dtype)
    weights = load_file(os.path.join(path, "model.safetensors"))
    adapter.norm.weight.requires_grad_(True)  # load_state_dict needs no grad flags; frozen again below
    adapter.load_state_dict(weights)
    return adapter.to(device).eval().requires_grad_(False)


def check_adapter(c: ExitAdapterConfig, path: str, target_path: str, hidden_size: int, layers: int) -> None:
    """Refuse an adapter trained for another target, naming both."""
    name = target_name(target_path)
    if c.target != name or c.hidden_size != hidden_size or c.num_layers != layers:
        raise ValueError(f"speculative_config.model {path!r} is an exit adapter for target {c.target!r} "
                         f"({c.num_layers} layers, hidden size {c.hidden_size}); this target is {name!r} "
                         f"({layers} layers, hidden size {hidden_size})")


class ExitHead:
    """Layer L's hidden states -> logits [T, V] float32: the adapter (if any), then the target's norm and head."""

    def __init__(self, model: nn.Module, adapter: ExitAdapter | None) -> None:
        self.target = model
        self.adapter = adapter

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            hidden = self.adapter(hidden)
        return self.target.compute_logits(self.target.model.norm(hidden)).float()
