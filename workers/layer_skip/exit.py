"""The exit of an early-exit draft: layer L's hidden state -> logits over the target's vocabulary.

Two kinds, both ending in the target's own final norm and head (no second vocabulary projection to ship):

- adapter-free: the final norm and head read layer L's hidden state directly: for checkpoints trained for early
  exit (LayerSkip's layer dropout + early-exit loss); a model not trained that way exits poorly;
- an exit adapter (Kangaroo-style, shallow): a residual MLP block on layer L's hidden state first, trained on a
  frozen target to match its next-token law (training/exit_adapter.py). Kangaroo's adapter has an attention layer;
  this one is position-local (no KV of its own to keep, roll back or reuse), which costs some acceptance.

An adapter directory holds ``config.json`` (``ExitAdapterConfig``: its L, the target it was trained for) and
``model.safetensors``, and may hold ``draft_vocab.json`` (``{"ids": [...]}``, the form of a separate draft's
draft_vocab_map.json): the exit then projects onto those rows of the head only. On a large vocabulary the head is
most of the exit's cost (SmolLM2: 49,152 rows, ~a quarter of a decode step per drafted token); the draft law is
zero outside the ids and recorded as such, so the verify stays lossless whatever the ids are.
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
VOCAB_FILE = "draft_vocab.json"  # optional, in an adapter directory: the token ids the exit may draft


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


def load_exit_vocab(path: str, vocab_size: int) -> list[int] | None:
    """The adapter directory's draft vocabulary (sorted, distinct, in range), or None when it has none."""
    file = os.path.join(path, VOCAB_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        ids = json.load(f)["ids"]
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{file}: ids must be distinct, sorted and in 0 .. {vocab_size - 1}")
    return ids


class ExitHead:
    """Layer L's hidden states -> logits [T, V] float32: the adapter (if any), then the target's norm and head
    (only the rows of ``vocab`` when given: every other id gets -inf, so the draft law is zero there)."""

    def __init__(self, model: nn.Module, adapter: ExitAdapter | None, vocab: list[int] | None = None) -> None:
        self.target = model
        self.adapter = adapter
        head = model.lm_head
        # A tensor-parallel head is sharded by rows: the restricted exit is for one rank's full head only.
        restrict = vocab is not None and head.tp.size == 1
        self.vocab = torch.tensor(vocab, device=head.weight.device) if restrict else None  # [Vd]
        self.rows = head.weight.detach()[self.vocab].contiguous() if restrict else None  # [Vd, H]
        self.vocab_size = head.vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            hidden = self.adapter(hidden)
        h = self.target.model.norm(hidden)  # [T, H]
        if self.rows is None:
            return self.target.compute_logits(h).float()
        # Draft tokens only: not row-invariant (no KV or verify logits depend on these bits; rank 0's draw is used).
        part = torch.nn.functional.linear(h.to(self.rows.dtype), self.rows).float()  # [T, Vd]
        out = part.new_full((h.shape[0], self.vocab_size), float("-inf"))  # [T, V]
        return out.index_copy_(1, self.vocab, part)
