"""The keys of method ``layer_skip`` (self-speculation), checked where the speculative config is
(engine/drafting/layer_skip.py chooses the exit and drafts; workers/layer_skip/ has the design note).

Keys: ``exit_layer`` (L, in 1 .. num_layers - 1), ``num_speculative_tokens`` (K), ``tree_branching`` (optional:
children per node at each depth; siblings drawn per ``tree_sampling``), ``model`` (optional:
an exit adapter directory, training/exit_adapter.py). Without ``model`` the exit is the target's own final norm
and head (for checkpoints trained for early exit); without either, a packaged target's shipped adapter and its L.
"""

from __future__ import annotations

from typing import Any

LAYER_SKIP = "layer_skip"


def check_layer_skip(spec: Any) -> None:
    """The keys this version can run, checked where the speculative config is built (before any worker)."""
    L = spec.exit_layer
    if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1):
        raise ValueError(f"speculative_config.exit_layer must be an integer >= 1 (a layer of the target), got {L!r}")
    if spec.fallback is not None:
        raise ValueError("speculative_config.fallback is for methods 'ngram' and 'suffix'")
    if spec.model is not None and (not isinstance(spec.model, str) or not spec.model):
        raise ValueError("speculative_config.model of method 'layer_skip' must be an exit adapter directory")
    if spec.pipeline:
        raise ValueError("speculative_config.pipeline: method 'layer_skip' drafts on the target itself, which "
                         "cannot verify and draft at once (set pipeline false)")
    if spec.adaptive is None:  # opt-in: the policy prices the target's own passes once it has measured them
        spec.adaptive = False
    if spec.num_draft_tokens is not None or spec.draft_tensor_parallel_size != 1 or spec.draft_process:
        raise ValueError("speculative_config: num_draft_tokens, draft_tensor_parallel_size and draft_process are "
                         "not keys of method 'layer_skip' (the target drafts itself)")
