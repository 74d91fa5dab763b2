"""Shared by the draft and target workers: model + cache construction."""

from __future__ import annotations

import torch

from workers.distributed import TPGroup
from workers.input_batch import SeqForward
from workers.loader import load_model
from workers.messages import PrefillSeq, SamplingSpec
from workers.model_config import ModelConfig, parse_dtype
from workers.model_runner import ModelRunner
from workers.sampling import SamplingBatch
from workers.worker_config import WorkerConfig


def auto_dtype(checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype, except half precision on a CPU: CPUs without native fp16/bf16 matmuls run them
    far slower than fp32 (measured: the built-in 10M target decodes 1.4x faster in fp32)."""
    if device.type == "cpu" and checkpoint in (torch.float16, torch.bfloat16):
        return torch.float32
    return checkpoint


class WorkerBase:
    def __init__(self, config: WorkerConfig, tp: TPGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TPGroup.single()
        self.model_config = (ModelConfig.from_dict(config.model_config) if config.model_config is not None
                             else ModelConfig.from_pretrained(config.model))
        self.device = torch.device(config.device)
        dtype = (parse_dtype(config.dtype, self.model_config.dtype) if config.dtype
                 else auto_dtype(self.model_config.dtype, self.device))
        self.model = load_model(config.model, dtype=dtype, device=self.device, tp=self.tp,
                                config=self.model_config, quantization=config.quantization)
        tp_size = self.tp.size
        mc = self.model_config
        if getattr(self.model, "compressed_state", False):  # DeepSeek-V4: per-sequence state, no paged KV
            from workers.compressed_state_runner import CompressedStateRunner

            self.runner: ModelRunner | CompressedStateRunner = CompressedStateRunner(self.model, self.device)
        else:
            self.runner = ModelRunner(self.model, mc.num_layers, mc.num_kv_heads_per_rank(tp_size), mc.head_dim,
                                      config.num_blocks, config.block_size, dtype, self.device)


def prefill_forward(p: PrefillSeq, logit_nodes: list[int] | None = None) -> SeqForward:
    """A prompt chunk as a causal chain; ``logit_nodes``: the chunk's rows to score (none: it only fills KV)."""
    n = len(p.token_ids)
    return SeqForward(block_table=p.block_table, base_len=p.base_len, parents=list(range(-1, n - 1)),
                      token_ids=p.token_ids, logit_nodes=logit_nodes or [])


def sampling_batch(specs: list[SamplingSpec], counts: list[int], device: torch.device) -> SamplingBatch:
    """One row per position: request i's parameters repeated counts[i] times."""
    rows = [s for s, c in zip(specs, counts, strict=True) for _ in range(c)]
    return SamplingBatch.from_lists([s.temperature for s in rows], [s.top_k for s in rows],
                                    [s.top_p for s in rows], [s.min_p for s in rows], device=device)
