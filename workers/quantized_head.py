"""The token embedding and output head kept in the GGUF file's own blocks (Q8_0 for SmolLM2's tied table).

A tied 49,152 x 576 table expanded to float32 is 113 MB, more than the whole 4-bit body, and the head reads all
of it every decode step (~12 ms as a one-row gemv here, and a gemv per row to stay row-invariant). Kept as the
file's Q8_0 blocks it is 30 MB: the head is the native block matmul (workers/kernels/gguf_blocks.py: one read of
the table for all rows of a verify, each logit summed in a fixed order, so row-invariant by construction), and
the embedding dequantizes only the looked-up rows (exactly: w = d q).

``quantize_head(model, weights)`` swaps ``model.model.embed_tokens`` / ``model.lm_head`` for these modules when
the native kernel is available, the model is on the CPU with one tensor-parallel rank, and the table is stored in
a block format the kernel reads; otherwise nothing changes (the float32 table and workers/row_invariant.py's
head). It returns the weights left for ``load_weights``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from workers.kernels import gguf_blocks

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def native_qtype(src: Any) -> int | None:
    """The kernel's id of ``src``'s block format (a ``GGUFSource``), None when it is not one it reads."""
    qtype = getattr(src, "qtype", None)
    return gguf_blocks.QTYPES.get(getattr(qtype, "name", None))


def raw_blocks(raw: np.ndarray) -> torch.Tensor:
    """A file's block bytes [N, bytes] (maybe a read-only map) -> an owned contiguous uint8 tensor."""
    return torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))


class _BlockTable(nn.Module):
    """A [V, E] table held as blocks [V, E / 32 * block bytes] uint8."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dtype: torch.dtype, tp: Any) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.qtype, self.dtype, self.tp = qtype, dtype, tp
        self.vocab_size = blocks.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table [V, E] (for code that reads the weight itself: drafter training, exit heads)."""
        return gguf_blocks.dequantize_reference(self.blocks, self.qtype).to(self.dtype)

    def nbytes(self) -> int:
        return self.blocks.numel()


class BlockEmbedding(_BlockTable):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = gguf_blocks.block_rows(self.blocks, input_ids.reshape(-1), self.qtype)  # [T, E]
        return flat.view(*input_ids.shape, -1).to(self.dtype)


class BlockHead(_BlockTable):
    head_gemv = False  # read by nothing here; kept so reports of ``ParallelLMHead`` attributes still work

    def __init__(self, blocks: torch.Tensor, qtype: int, dtype: torch.dtype, tp: Any, activations: str = "f32") -> None:
        super().__init__(blocks, qtype, dtype, tp)
        self.activations = activations
        # "q8": the table repacked for the 8-bit-activation kernel (a second copy: the embedding reads the file's)
        self.register_buffer("packed", gguf_blocks.pack_q8(blocks, qtype) if activations == "q8" else None)

    def nbytes(self) -> int:
        return self.blocks.numel() + (self.packed.numel() if self.packed is not None else 0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use BlockHead.logits(hidden)")

    def logits(self, hidden: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """hidden [N, E] -> [N, V] float32; row-invariant whatever ``row_invariant`` says (one kernel for all)."""
        held = self.packed if self.activations == "q8" else self.blocks
        return gguf_blocks.held_matmul(hidden.float().contiguous(), held, self.qtype, self.vocab_size,
                                       self.activations)  # [N, V]


def quantize_head(model: nn.Module, weights: list[tuple[str, Any]],
                  activations: str = "f32") -> tuple[list[tuple[str, Any]], int]:
    """Swap in block-held embedding / head where possible; returns (weights left, bytes now held as blocks)."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or head is None or head.tp.size != 1 or head.weight.device.type != "cpu":
        return weights, 0
    sources = dict(weights)
    taken: set[str] = set()
    held = 0
    tied = model.config.tie_word_embeddings
    embed_src = sources.get(EMBED)
    if embed_src is not None and native_qtype(embed_src) is not None and embed_src.get_shape()[0] == head.vocab_size:
        table = raw_blocks(embed_src.raw_rows(0, embed_src.get_shape()[0]))
        qtype, dtype = native_qtype(embed_src), inner.embed_tokens.weight.dtype
        inner.embed_tokens = BlockEmbedding(table, qtype, dtype, head.tp)
        taken.add(EMBED)
        held += table.numel()
        if tied:
            model.lm_head = BlockHead(table, qtype, dtype, head.tp, activations)
            held += model.lm_head.nbytes() - table.numel()  # the repacked copy, if any
    head_src = sources.get(HEAD)
    if (not tied and head_src is not None and native_qtype(head_src) is not None
            and head_src.get_shape()[0] == head.vocab_size):
        table = raw_blocks(head_src.raw_rows(0, head_src.get_shape()[0]))
        model.lm_head = BlockHead(table, native_qtype(head_src), head.weight.dtype, head.tp, activations)
        taken.add(HEAD)
        held += model.lm_head.nbytes()
    return [(n, s) for n, s in weights if n not in taken], held
