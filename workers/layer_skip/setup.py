"""Building a target worker's self-drafter from its WorkerConfig (``layer_skip_exit_layer`` > 0)."""

from __future__ import annotations

from typing import Any

from workers.layer_skip.exit import ExitHead, check_adapter, load_adapter, load_exit_vocab
from workers.layer_skip.self_drafter import SelfDrafter


def build_self_drafter(worker: Any) -> SelfDrafter | None:
    """``worker``: a TargetWorker (its runner, config and law store); None when the config asks for no drafting."""
    cfg = worker.config
    if not cfg.layer_skip_exit_layer:
        return None
    adapter, vocab = None, None
    if cfg.layer_skip_adapter:
        vocab = load_exit_vocab(cfg.layer_skip_adapter, worker.model_config.vocab_size)
        adapter = load_adapter(cfg.layer_skip_adapter, device=worker.device)
        c = adapter.config
        check_adapter(c, cfg.layer_skip_adapter, cfg.model, worker.model_config.hidden_size,
                      worker.model_config.num_layers)
        if c.exit_layer != cfg.layer_skip_exit_layer:
            raise ValueError(f"exit adapter {cfg.layer_skip_adapter!r} reads layer {c.exit_layer}, "
                             f"not exit_layer {cfg.layer_skip_exit_layer}")
    return SelfDrafter(worker.runner, cfg.layer_skip_exit_layer, ExitHead(worker.model, adapter, vocab),
                       cfg.draft_seed_salt, worker.law_store.put if worker.tp.is_first else None, worker.tp,
                       cfg.tree_sampling)
