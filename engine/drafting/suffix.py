"""Suffix decoding (vLLM's ``suffix`` method): propose a tree of the most frequent continuations of the longest
match, from the request's own tokens and from a bounded cache of recent requests' outputs.

- Per running request: a suffix trie over its prompt and output, extended by the tokens new since its last
  round, indexing only its last ``max_request_tokens`` tokens (older starts are dropped as it grows). A
  request that finishes, is aborted or preempted leaves its trie behind at once (a preempted one rebuilds it
  when it runs again).
- Cross-request: a trie per tenant (the request's ``tenant``: a digest of the server's API key and served model
  name, or None) over the
  outputs of that tenant's finished requests, never another's (acceptance timing would reveal them), FIFO-evicted
  past ``max_cached_requests`` requests or ``max_cached_tokens`` tokens over all tenants; aborted requests are
  not cached. ``cross_request`` false: no cache at all. Seeded sampled requests draft from their own tokens only
  (their seed must reproduce their output whatever ran before).

Of the two proposals (own, cache) the one with more expected accepted tokens is taken. Proposals are functions of
the tokens and the cache, so each node's law is one-hot at its token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.drafting.draftless_config import SuffixConfig
from engine.drafting.suffix_tree import Proposal, SuffixTrie


@dataclass
class SuffixCache:
    """Finished outputs by tenant, bounded in requests and tokens; oldest evicted first."""

    max_depth: int
    max_requests: int
    max_tokens: int
    tries: dict[str | None, SuffixTrie] = field(default_factory=dict)
    _fifo: deque[tuple[str | None, list[int]]] = field(default_factory=deque)
    num_tokens: int = 0

    def add(self, tenant: str | None, output: list[int]) -> None:
        output = output[-self.max_tokens:]  # never more than the whole budget
        if not output or self.max_requests == 0:
            return
        trie = self.tries.get(tenant)
        if trie is None:
            trie = self.tries[tenant] = SuffixTrie(self.max_depth)
        trie.add(output)
        self._fifo.append((tenant, output))
        self.num_tokens += len(output)
        while len(self._fifo) > self.max_requests or self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        tenant, output = self._fifo.popleft()
        trie = self.tries[tenant]
        trie.remove(output)
        self.num_tokens -= len(output)
        if trie.num_nodes == 0:
            del self.tries[tenant]

    @property
    def num_requests(self) -> int:
        return len(self._fifo)

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self.tries.values())


@dataclass
class SuffixProposer:
    config: SuffixConfig
    name: str = "suffix"
    cache: SuffixCache = field(init=False)
    _own: dict[int, SuffixTrie] = field(default_factory=dict)  # seq_id -> trie over its tokens

    def __post_init__(self) -> None:
        c = self.config
        self.cache = SuffixCache(c.max_tree_depth, c.max_cached_requests if c.cross_request else 0,
                                 c.max_cached_tokens)

    def propose(self, seq_id: int, token_ids: list[int], max_nodes: int, max_depth: int,
                tenant: str | None = None, shared: bool = True) -> tuple[list[int], list[int]]:
        c = self.config
        trie = self._own.get(seq_id)
        if trie is None or trie.num_appended > len(token_ids):
            trie = self._own[seq_id] = SuffixTrie(c.max_tree_depth)
        trie.append(token_ids[trie.num_appended:])
        trie.drop_oldest(token_ids, c.max_request_tokens)
        args = (max_nodes, max_depth, c.max_spec_factor, c.min_token_prob)
        best: Proposal | None = trie.propose(token_ids, True, *args)
        cached = self.cache.tries.get(tenant) if shared else None
        if cached is not None:
            other = cached.propose(token_ids, False, *args)
            if other is not None and (best is None or other.score > best.score):
                best = other
        return (best.tokens, best.parents) if best is not None else ([], [])

    def forget(self, seq_id: int, output: list[int] | None = None, tenant: str | None = None) -> None:
        """The request left: its own trie goes; ``output`` (a finished, not aborted, request's) is cached."""
        self._own.pop(seq_id, None)
        if output:
            self.cache.add(tenant, output)

    @property
    def num_requests(self) -> int:
        return len(self._own)

    @property
    def own_nodes(self) -> int:
        """Trie nodes held for running requests (each bounded by ``max_request_tokens``)."""
        return sum(t.num_nodes for t in self._own.values())
