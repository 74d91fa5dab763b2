"""Which replica gets a request: least outstanding tokens, prefix affinity, or round-robin (stdlib only).

A speculative engine's cost per request is its tokens, not its request count: a 2,000-token prompt and a
10-token one are one "ongoing request" each to Ray Serve's default (power of two choices on queue length), but
not to the engine. So the ingress keeps a ledger of the tokens it has sent each replica and not yet seen finish
(prompt + max_tokens, an upper bound that needs no feedback from the replica) and ranks replicas by it.

Prefix affinity sends requests that share their first full KV blocks to the replica that has those blocks in its
prefix cache (scheduler/prefix_cache.py names a block by a hash chained over its prefix: the hash of block k
names the whole prefix up to it). The key is the chained hash of the first ``prefix_blocks`` full blocks;
the replica is the one that scores highest for that key (rendezvous hashing), so a replica that joins or leaves
moves only its own share of the keys. A prefix that would pile onto one replica goes to the least loaded
instead once that replica carries ``imbalance_tokens`` more than the lightest.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.prefix_cache import chain_hashes

POLICIES = ("least_tokens", "prefix", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "least_tokens"  # one of POLICIES
    block_size: int = 16  # must be the replicas' KV block size, or the keys name no cached block
    # Full blocks that make the affinity key: more separates prefixes that share only a short start (a chat
    # template) at the cost of requiring that much shared prefix before affinity applies at all.
    prefix_blocks: int = 4
    # How much busier (outstanding tokens) the affine replica may be than the least loaded before the request
    # goes to the least loaded: higher keeps more cache hits, lower keeps the load even under one hot prefix.
    imbalance_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.block_size < 1 or self.prefix_blocks < 1 or self.imbalance_tokens < 0:
            raise ValueError(f"routing: block_size and prefix_blocks must be >= 1 and imbalance_tokens >= 0; got "
                             f"{self.block_size}, {self.prefix_blocks}, {self.imbalance_tokens}")


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs to know of a request: its prompt (prefix key) and its cost in tokens."""

    prompt_token_ids: Sequence[int]
    max_tokens: int

    @property
    def cost(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


class TokenLedger:
    """Tokens sent to each replica and not yet finished, by request."""

    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, int]] = {}
        self._by_replica: dict[str, int] = {}

    def outstanding(self, replica: str) -> int:
        return self._by_replica.get(replica, 0)

    def start(self, replica: str, request: str, tokens: int) -> None:
        self.finish(request)  # a request routed again (a retry) counts once, where it is now
        self._by_request[request] = (replica, tokens)
        self._by_replica[replica] = self._by_replica.get(replica, 0) + tokens

    def finish(self, request: str) -> None:
        entry = self._by_request.pop(request, None)
        if entry is not None:
            replica, tokens = entry
            self._by_replica[replica] -= tokens

    def drop_replica(self, replica: str) -> None:
        """A dead replica: its requests will be retried elsewhere (and counted there)."""
        self._by_replica.pop(replica, None)
        for rid in [r for r, (rep, _) in self._by_request.items() if rep == replica]:
            del self._by_request[rid]


def prefix_key(tokens: Sequence[int], block_size: int, prefix_blocks: int) -> bytes | None:
    """The chained hash of the prompt's first ``prefix_blocks`` full blocks; None if it has no full block."""
    hashes = chain_hashes(tokens, block_size, [], prefix_blocks)
    return hashes[-1] if hashes else None


def _affinity(key: bytes, replica: str) -> bytes:
    return hashlib.blake2b(key + replica.encode(), digest_size=8).digest()


class RoutingPolicy:
    """Ranks replica ids for a request, most preferred first (the caller sends to the first that has room)."""

    def __init__(self, config: RoutingConfig, ledger: TokenLedger | None = None) -> None:
        self.config = config
        self.ledger = ledger if ledger is not None else TokenLedger()
        self._turn = itertools.count()

    def rank(self, replicas: Sequence[str], request: RouteRequest | None) -> list[str]:
        if not replicas:
            return []
        ids = sorted(replicas)  # a stable order: ties and round-robin do not depend on the caller's order
        if self.config.policy == "round_robin":
            start = next(self._turn) % len(ids)
            return ids[start:] + ids[:start]
        by_load = sorted(ids, key=self.ledger.outstanding)  # stable: ties keep the id order
        if self.config.policy == "least_tokens" or request is None:
            return by_load
        key = prefix_key(request.prompt_token_ids, self.config.block_size, self.config.prefix_blocks)
        if key is None:
            return by_load
        home = max(ids, key=lambda r: _affinity(key, r))
        if self.ledger.outstanding(home) - self.ledger.outstanding(by_load[0]) > self.config.imbalance_tokens:
            return by_load
        return [home] + [r for r in by_load if r != home]
