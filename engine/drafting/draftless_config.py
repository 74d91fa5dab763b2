"""The keys of the draftless methods (vLLM's ``ngram`` and ``suffix``), checked where the speculative config is.

``SpeculativeConfig`` (engine/core/config.py) carries the keys, as users write them; this module validates
them, fills vLLM's defaults, and hands each drafter its own part (``NgramConfig`` / ``SuffixConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DRAFTLESS_METHODS = ("ngram", "suffix")
NGRAM_DEFAULT_LOOKUP = 5  # vLLM: both bounds 5 when neither is given; one given sets the other
SUFFIX_DEFAULT_MAX_TREE_DEPTH = 24  # vLLM's default (also the default K: a match can be copied this far)


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int  # K: the longest chain proposed
    prompt_lookup_min: int  # shortest suffix matched: shorter matches propose more often, more wrongly
    prompt_lookup_max: int  # longest suffix tried first: longer ones find fewer but surer continuations


@dataclass(frozen=True)
class SuffixConfig:
    max_tree_depth: int = SUFFIX_DEFAULT_MAX_TREE_DEPTH  # pattern + continuation length indexed: memory x depth
    max_cached_requests: int = 10_000  # finished outputs kept for other requests (0: none); memory vs reach
    max_spec_factor: float = 1.0  # nodes proposed <= factor x match length: long matches speculate longer
    min_token_prob: float = 0.1  # a continuation seen less often than this (relative count) is not proposed
    cross_request: bool = True  # false: draft from the request's own tokens only (no cache across requests)
    # tokens of cached outputs over all tenants, the memory bound: up to max_tree_depth - 1 trie nodes of ~260
    # bytes per token (random text at depth 24: 6 KB a token, so ~100 MB at this bound); more reaches further back
    max_cached_tokens: int = 1 << 14
    # a running request's own trie indexes only its last this-many tokens (prompt + output): memory per request
    # (up to max_tree_depth - 1 nodes a token) vs matches further back in a long context
    max_request_tokens: int = 1 << 13


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_draftless(spec: Any) -> None:
    """Validate and default the draftless keys of a SpeculativeConfig whose method is ngram or suffix, in place."""
    m = spec.method
    if spec.pipeline:
        raise ValueError(f"speculative_config.pipeline: method {m!r} proposes in the controller at no cost; "
                         "there is nothing to overlap (set pipeline false)")
    if spec.adaptive is None:
        spec.adaptive = False
    if spec.num_speculative_tokens_per_batch_size is not None:
        raise ValueError(f"speculative_config.num_speculative_tokens_per_batch_size: not with method {m!r}")
    if spec.tree_sampling != "iid":
        raise ValueError(f"speculative_config.tree_sampling: method {m!r} proposes deterministically")
    if m == "ngram":
        if spec.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required with method 'ngram'")
        if spec.tree_branching is not None:
            raise ValueError("speculative_config.tree_branching: method 'ngram' proposes a chain")
        lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        spec.prompt_lookup_min = _int("prompt_lookup_min", lo, 1, 1024)
        spec.prompt_lookup_max = _int("prompt_lookup_max", hi, 1, 1024)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    else:
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(spec, key) is not None:
                raise ValueError(f"speculative_config.{key} is a key of method 'ngram', not {m!r}")
        depth = _int("suffix_decoding_max_tree_depth", spec.suffix_decoding_max_tree_depth, 1, 64)
        _int("suffix_decoding_max_cached_requests", spec.suffix_decoding_max_cached_requests, 0, 1_000_000)
        f, p = spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 64:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be in (0, 64], got {f!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")
        _int("suffix_decoding_max_request_tokens", spec.suffix_decoding_max_request_tokens, depth, 1 << 24)
        if not isinstance(spec.suffix_decoding_cross_request, bool):
            raise ValueError("speculative_config.suffix_decoding_cross_request must be true or false")
        if spec.num_speculative_tokens is None and spec.tree_branching is None:
            spec.num_speculative_tokens = min(depth, 32)
    spec.model = None  # a draft model goes in ``fallback`` (the CLI adds the built-in draft's path: not used)
    if spec.fallback is not None:
        fb = spec.fallback
        # A fallback drafts rounds the draftless method leaves: a fixed depth within its own, so adaptive off.
        spec.fallback = type(spec).parse({"adaptive": False, **fb} if isinstance(fb, dict) else fb)


def check_fallback(spec: Any) -> None:
    """After the round's shape is known: the fallback drafts within the nodes the scheduler reserves."""
    fb = spec.fallback
    if fb is not None:
        if fb.method in DRAFTLESS_METHODS or fb.pipeline or fb.is_adaptive:
            raise ValueError("speculative_config.fallback must be a draft model's config ({\"model\": DIR, ...}) "
                             "with pipeline and adaptive off")
        if fb.tree_shape.num_nodes > spec.tree_shape.num_nodes or fb.tree_shape.depth > spec.tree_shape.depth:
            raise ValueError(f"speculative_config.fallback drafts {fb.tree_shape.num_nodes} nodes, more than the "
                             f"round's {spec.tree_shape.num_nodes} (num_speculative_tokens / tree_branching)")


def ngram_config(spec: Any) -> NgramConfig:
    return NgramConfig(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def suffix_config(spec: Any) -> SuffixConfig:
    return SuffixConfig(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                        float(spec.suffix_decoding_max_spec_factor), float(spec.suffix_decoding_min_token_prob),
                        spec.suffix_decoding_cross_request,
                        max_request_tokens=spec.suffix_decoding_max_request_tokens)
