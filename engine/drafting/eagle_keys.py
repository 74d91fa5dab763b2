"""The EAGLE keys of ``speculative_config`` (engine/core/config.py calls this; no import of it here).

- ``method`` "eagle3" / "eagle": ``model`` is an EAGLE head in vLLM's layout (default on a packaged target: its
  shipped head, engine/drafting/eagle.py);
- ``num_draft_tokens``: EAGLE-2 dynamic trees of that many nodes, depth ``num_speculative_tokens`` (the round
  reserves exactly that: ``SpeculativeConfig.tree_shape``), ``eagle_topk`` children per expanded node, one-hot q;
  unset: chains of K (or ``tree_branching``). Not with pipelining, a draft process or a multi-rank draft.
"""

from __future__ import annotations

from typing import Any


def check_eagle_keys(spec: Any, methods: tuple[str, ...]) -> None:
    """``num_draft_tokens`` / ``eagle_topk`` and what EAGLE cannot combine with, each refused saying what to set."""
    n, k = spec.num_draft_tokens, spec.eagle_topk
    if n is not None and spec.method not in methods:
        raise ValueError("speculative_config.num_draft_tokens is for EAGLE dynamic trees (method eagle3 / eagle)")
    if spec.method not in methods:
        return
    if spec.pipeline:
        raise ValueError("speculative_config: EAGLE heads cannot pipeline (pre-drafting round r+1 needs the "
                         "target's hidden states of round r, which do not exist yet); set pipeline=false")
    if spec.draft_process or spec.draft_tensor_parallel_size != 1:
        raise ValueError("speculative_config: an EAGLE head runs on one draft rank (a thread beside an in-process "
                         "target, or the Ray draft actor): set draft_process=false, draft_tensor_parallel_size=1")
    if spec.quantization == "gguf":
        raise ValueError("speculative_config.quantization: an EAGLE head is a safetensors checkpoint; use 'q8_0' "
                         "(its matrices as Q8_0 blocks) or 'none'")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config.eagle_topk must be an integer in [1, 16], got {k!r}")
    if n is not None:
        depth = spec.num_speculative_tokens
        if spec.tree_branching is not None:
            raise ValueError("speculative_config: num_draft_tokens (a dynamic tree) and tree_branching (a "
                             "fixed one) exclude each other")
        if isinstance(n, bool) or not isinstance(n, int) or not depth <= n <= spec.max_tree_nodes:
            raise ValueError(f"speculative_config.num_draft_tokens must be an integer in [num_speculative_tokens"
                             f" ({depth}), max_tree_nodes ({spec.max_tree_nodes})], got {n!r}")


def dynamic_topk(spec: Any) -> int:
    """Children per expanded node of an EAGLE-2 dynamic tree; 0: not a dynamic tree."""
    return spec.eagle_topk if spec.is_eagle and spec.num_draft_tokens is not None else 0
