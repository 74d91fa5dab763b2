"""Automatic prefix caching: what identifies a full KV block, and the counters (stdlib only).

A full block of ``block_size`` tokens is named by a hash chained over its prefix: ``hash(parent, tokens,
extra)``, where ``parent`` is the previous block's hash and ``extra`` anything else that changes the block's
content for a request (a LoRA, multimodal inputs later; empty today). Two requests whose first k blocks hash
alike have the same tokens in the same positions after the same prefix, so the K/V of those blocks is the same
and one copy can serve both. The model is not in the chain: each pool (``BlockManager``) keeps its own map and
prefixes every key with its namespace (the model it caches), so a target block never answers a draft query.

The hash is blake2b over the tokens' bytes (vLLM v1 uses sha256 or a fast non-cryptographic hash): stable across
processes, and a collision (two prefixes sharing a block, the failure ``tests/test_prefix_poison.py`` shows the
invariant tests catch) is out of reach.

What may be cached is decided by the scheduler (``Scheduler._register_cached``): a block is offered only once it
is full and committed, never a scratch-pad block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
HashFn = Callable[[BlockHash, Sequence[int], tuple], BlockHash]

ROOT_HASH: BlockHash = b""  # the parent of a sequence's first block


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: tuple = ()) -> BlockHash:
    """The name of a full block: its prefix's hash, its token ids and the request's extra keys."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, have: list[BlockHash], num_blocks: int,
                 extra: tuple = (), hash_fn: HashFn = hash_block) -> list[BlockHash]:
    """Extend ``have`` (the hashes of the first blocks, kept on the request) to ``num_blocks`` full blocks."""
    for i in range(len(have), min(num_blocks, len(tokens) // block_size)):
        parent = have[i - 1] if i else ROOT_HASH
        have.append(hash_fn(parent, tokens[i * block_size:(i + 1) * block_size], extra))
    return have


def namespace(*model: object) -> bytes:
    """A pool's key prefix from what computed its blocks (the model's path, weight format, dtype)."""
    return repr(model).encode()


@dataclass
class PrefixCacheStats:
    """vLLM's prefix-cache counters, in prompt tokens: ``queries`` looked up at admission, ``hits`` found cached
    on the target; ``draft_hits`` counts apart what the draft found, so a target hit that the draft missed (and
    recomputes) shows. Hit rate = hits / queries."""

    requests: int = 0  # admissions that looked the cache up
    queries: int = 0  # tokens looked up (each admission's prefill length)
    hits: int = 0  # tokens whose target prefill was skipped
    draft_hits: int = 0  # of those, tokens the draft had cached too (the rest the draft computes)

    def record(self, queried: int, hit: int, draft_hit: int = 0) -> None:
        self.requests += 1
        self.queries += queried
        self.hits += hit
        self.draft_hits += draft_hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict:
        return {"prefix_cache_requests": self.requests, "prefix_cache_queries": self.queries,
                "prefix_cache_hits": self.hits, "prefix_cache_draft_hits": self.draft_hits,
                "prefix_cache_hit_rate": round(self.hit_rate, 4)}
