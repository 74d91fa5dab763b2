"""What a worker needs to build its model and cache (its own sub-config, nothing else)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # Hugging Face checkpoint directory or GGUF file
    num_blocks: int  # KV cache blocks in this worker's pool
    block_size: int
    dtype: str | None = None  # None: the checkpoint's dtype
    device: str = "cpu"
    quantization: str | None = None  # GGUF only: "gguf" keeps Q4 weights packed, "none"; None: by the file
    tree_sampling: str = "iid"  # how siblings are drawn at temperature > 0 (draft only; see workers/proposal.py)
    target_vocab_size: int | None = None  # draft only: q is padded to the target's vocabulary
    tokenizer: str | None = None  # draft only: the target's tokenizer, for grammar masks (None: the draft's own)
    # Seeded requests derive their draft stream from the seed with this salt, so the draft's draws never
    # coincide with the verifier's uniforms (the acceptance test needs them independent).
    draft_seed_salt: int = 0x5EED_D4AF7
    # ModelConfig.to_dict() of ``model`` as the controller read it (None: the worker reads it, importing
    # transformers); JSON-safe, as the draft process's start line carries it.
    model_config: dict | None = None
    # The target's last-resort wait for a live draft's laws (the executor sets it from ParallelConfig).
    step_timeout_s: float = 600.0
    num_threads: int = 1  # torch CPU threads in this worker's process
    # EAGLE head drafts only (workers/eagle/): the target checkpoint (its embedding / head when the head has none)
    # and its ModelConfig.to_dict(); eagle_topk > 0: EAGLE-2 dynamic trees of that many children per node.
    eagle_target: str | None = None
    eagle_target_config: dict | None = None
    eagle_topk: int = 0
    # Self-speculation (workers/layer_skip/), target only: the target drafts with its layers 0..L-1 and an exit
    # (0: it does not); the exit adapter's directory (None: the target's own final norm and head).
    layer_skip_exit_layer: int = 0
    layer_skip_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {self.num_blocks}, {self.block_size}")
        if not self.step_timeout_s > 0 or self.num_threads < 1:
            raise ValueError(f"step_timeout_s must be > 0 and num_threads >= 1, got {self.step_timeout_s}, "
                             f"{self.num_threads}")
