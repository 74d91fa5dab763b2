"""A float checkpoint's matrices held as Q8_0 blocks on the native block kernel (``quantization: "q8_0"``).

Why: a draft is read once per drafted token, so its weight bytes are its cost. SmolLM2's shipped 2-layer draft is
40 MB in float32 and its EAGLE head's matrices 26 MB; a one-row forward of either took ~3 ms here (the weights
stream at ~12 GB/s through torch's float gemv), about half of a 4-bit target step, four times a round. As Q8_0
(34 bytes per 32 weights) the same matrices are ~3.8x smaller and go through the kernel the 4-bit target
uses (workers/kernels/gguf_blocks.py: each weight row read once for all rows of a call, every output summed in
a fixed order, so a row's result never depends on its batch), and a Llama draft's layers then run as the
target's do, a few native calls each (workers/kernels/layer_glue.py).

What it changes: the model is another, slightly different model (weights rounded to 8 bits per 32-block,
activations too with ``KernelConfig.gguf_activations = "q8"``), as llama.cpp's Q8_0 files are. For a draft that
is free: the laws it records are the ones it drew from, so the output stays the target's. For a target it is the
user's choice of a quantized model (its speculative and plain outputs stay equal to each other).

``hold_as_q8(model)`` swaps, on a CPU with the native kernel and one tensor-parallel rank, every float matrix
whose input width is whole 32-weight blocks: column / row parallel layers (through ``layer.quant``), plain
``nn.Linear`` modules (an EAGLE head's) and the output head; embeddings stay float (a lookup reads one row).
Anything else keeps its float weights, and the engine says once why.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workers.kernels import gguf_blocks
from workers.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from workers.quantized_head import BlockHead
from workers.quantized_linear import GROUP, BlockLinear, activations, use_native

log = logging.getLogger(__name__)

Q8_0 = gguf_blocks.QTYPES["Q8_0"]
_said: set[str] = set()


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float (K a multiple of 32) -> [N, K / 32 * 34] uint8 in ggml's Q8_0 layout: per 32-block a float16
    scale d = max|w| / 127 and 32 int8 q = round(w / d), so w ~ d q within about d / 2. The rounding is the native
    kernel's own (``gguf_blocks.quantize_activations``, what its 8-bit activations get, as ggml quantizes Q8_0)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q8_0 needs whole {GROUP}-weight blocks per row, got {k} columns")
    q, d = gguf_blocks.quantize_activations(weight.detach().float().contiguous())  # [N, K] int8, [N, K / 32]
    out = torch.empty(n, k // GROUP, 2 + GROUP, dtype=torch.uint8)
    out[..., :2] = d.half().unsqueeze(-1).view(torch.uint8)  # d is already a float16 value
    out[..., 2:] = q.view(n, k // GROUP, GROUP).view(torch.uint8)
    return out.reshape(n, -1)


def _say_once(why: str) -> None:
    if why not in _said:
        _said.add(why)
        log.warning("quantization q8_0: %s; those weights stay float", why)


def _fits(weight: torch.Tensor | None) -> bool:
    return weight is not None and weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.is_floating_point()


class BlockLinearModule(nn.Module):
    """An ``nn.Linear`` as Q8_0 blocks: y = x W^T (+ b), [T, in] -> [T, out] in x's dtype."""

    def __init__(self, linear: nn.Linear, acts: str) -> None:
        super().__init__()
        self.inner = BlockLinear(q8_0_blocks(linear.weight), Q8_0, acts)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y if self.bias is None else y + self.bias


def hold_as_q8(model: nn.Module) -> list[str]:
    """Swap ``model``'s float matrices for Q8_0 blocks where they fit (see the module docstring); returns the
    names of the modules swapped (empty when the native kernel cannot run here)."""
    if not use_native(model):
        _say_once("the native block kernel is not in use (a GPU, SPECSERVE_GGUF_KERNEL=0, or it did not build)")
        return []
    acts = activations()
    done: list[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if module.quant is None and module.tp.size == 1 and _fits(module.weight):
                module.quant = BlockLinear(q8_0_blocks(module.weight), Q8_0, acts)
                module.weight = None  # the blocks stand in for it
                done.append(name)
        elif isinstance(module, nn.Linear) and _fits(module.weight):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, BlockLinearModule(module, acts))
            done.append(name)
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead):
        if head.tp.size == 1 and _fits(head.weight):
            model.lm_head = BlockHead(q8_0_blocks(head.weight), Q8_0, head.weight.dtype, head.tp, acts)
            done.append("lm_head")  # a tied embedding keeps the float table as its own
        else:
            _say_once("an output head split over ranks or of odd width")
    inner = getattr(model, "model", None)
    if done and hasattr(inner, "set_glue"):
        inner.set_glue()  # a Llama's layers as a few native calls each, as a 4-bit target's run
    return done
