"""The keys of method ``layer_skip`` (self-speculation), checked where the speculative config is, and the exit
they choose for a target (engine/drafting/layer_skip.py has the drafter; workers/layer_skip/ the design note).

Keys: ``exit_layer`` (L, in 1 .. num_layers - 1), ``num_speculative_tokens`` (K, chains), ``model`` (optional:
an exit adapter directory, training/exit_adapter.py). Without ``model`` the exit is the target's own final norm
and head (for checkpoints trained for early exit); without either, a packaged target's shipped adapter and its L.
"""

from __future__ import annotations

from typing import Any

from workers.layer_skip.exit import ExitAdapterConfig, check_adapter, target_name

LAYER_SKIP = "layer_skip"
# The exit adapter shipped for a packaged target (engine/default_models/<dir>), keyed by target_name(): what
# ``{"method": "layer_skip"}`` without ``exit_layer`` or ``model`` uses, at the adapter's own L.
SHIPPED_EXITS = {"target": "target-exit"}


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
    if spec.adaptive is None:
        spec.adaptive = False
    if spec.adaptive:
        raise ValueError("speculative_config.adaptive is not supported with method 'layer_skip' yet: it runs "
                         "num_speculative_tokens")
    if spec.tree_branching is not None and any(b != 1 for b in spec.tree_branching):
        raise ValueError("speculative_config.tree_branching: method 'layer_skip' drafts chains in this version")
    if spec.num_draft_tokens is not None or spec.draft_tensor_parallel_size != 1 or spec.draft_process:
        raise ValueError("speculative_config: num_draft_tokens, draft_tensor_parallel_size and draft_process are "
                         "not keys of method 'layer_skip' (the target drafts itself)")


def shipped_exit(target: str) -> str | None:
    from engine.core.config import DEFAULT_MODELS_DIR

    sub = SHIPPED_EXITS.get(target_name(target))
    path = DEFAULT_MODELS_DIR / sub if sub else None
    return str(path) if path is not None and (path / "config.json").is_file() else None


def resolve_exit(spec: Any, target: str, tcfg: Any) -> tuple[int, str | None]:
    """(L, the exit adapter's directory or None for the target's own norm and head), checked against the target."""
    adapter = spec.model
    if adapter is None and spec.exit_layer is None:
        adapter = shipped_exit(target)
        if adapter is None:
            raise ValueError(f"method 'layer_skip': no exit adapter is shipped for target {target_name(target)!r}: "
                             "pass exit_layer (the target's own norm and head exit there) or model (an exit adapter "
                             "directory, python -m training.exit_adapter)")
    L = spec.exit_layer
    if adapter is not None:
        c = ExitAdapterConfig.from_pretrained(adapter)
        check_adapter(c, adapter, target, tcfg.hidden_size, tcfg.num_layers)
        if L is not None and L != c.exit_layer:
            raise ValueError(f"speculative_config.exit_layer {L}: the exit adapter {adapter!r} was trained on "
                             f"layer {c.exit_layer}")
        L = c.exit_layer
    if not 1 <= L <= tcfg.num_layers - 1:
        raise ValueError(f"speculative_config.exit_layer must be in 1 .. {tcfg.num_layers - 1} (the target has "
                         f"{tcfg.num_layers} layers), got {L}")
    return L, adapter
