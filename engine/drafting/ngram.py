"""Prompt lookup (vLLM's ``ngram`` method): continue the request's last n tokens the way they continued before.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: if the request's last n tokens (prompt and
output) occurred earlier, propose the (up to) K tokens that followed the most recent earlier occurrence; no
occurrence: propose nothing (a plain decode round). The proposal is a function of the tokens alone, so its law
is one-hot at each proposed token.

Each request keeps an index from its ``prompt_lookup_min``-grams to where they ended, extended by the tokens
new since its last round (no rescans); a lookup checks at most ``max_candidates`` of the most recent ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.drafting.draftless_config import NgramConfig


@dataclass
class NgramIndex:
    """One request's tokens and the end positions of each ``n``-gram in them (n = prompt_lookup_min)."""

    n: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions (exclusive)

    def extend(self, new: list[int]) -> None:
        n, toks = self.n, self.tokens
        for t in new:
            toks.append(t)
            if len(toks) >= n:
                self.ends.setdefault(tuple(toks[-n:]), []).append(len(toks))


@dataclass
class NgramProposer:
    """The ``ngram`` drafter's per-request state and its lookup."""

    config: NgramConfig
    max_candidates: int = 64  # earlier occurrences checked per lookup: bounds its cost on long, repetitive text
    name: str = "ngram"
    _index: dict[int, NgramIndex] = field(default_factory=dict)  # seq_id -> index

    def propose(self, seq_id: int, token_ids: list[int], max_nodes: int, max_depth: int,
                tenant: str | None = None, shared: bool = True) -> tuple[list[int], list[int]]:
        """A chain (tokens, parents) of at most min(K, max_nodes, max_depth) tokens; empty without a match."""
        idx = self._index.get(seq_id)
        if idx is None or len(idx.tokens) > len(token_ids):
            idx = self._index[seq_id] = NgramIndex(self.config.prompt_lookup_min)
        idx.extend(token_ids[len(idx.tokens):])
        k = min(self.config.num_speculative_tokens, max_nodes, max_depth)
        chain = lookup(idx, self.config.prompt_lookup_max, k, self.max_candidates)
        return chain, list(range(-1, len(chain) - 1))

    def forget(self, seq_id: int, output: list[int] | None = None, tenant: str | None = None) -> None:
        self._index.pop(seq_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._index)


def lookup(idx: NgramIndex, max_n: int, k: int, max_candidates: int) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the longest matching suffix (n in [min, max])."""
    toks, n_min = idx.tokens, idx.n
    end = len(toks)
    if k <= 0 or end <= n_min:
        return []
    ends = idx.ends.get(tuple(toks[-n_min:]), [])
    best_len, best_end = 0, -1
    checked = 0
    for e in reversed(ends):
        if e >= end:  # the suffix itself
            continue
        checked += 1
        length = n_min  # the index guarantees the last n_min tokens match; extend backwards up to max_n
        while length < max_n and e - length - 1 >= 0 and toks[e - length - 1] == toks[end - length - 1]:
            length += 1
        if length > best_len:
            best_len, best_end = length, e
            if length >= max_n:
                break
        if checked >= max_candidates:
            break
    return toks[best_end: best_end + k] if best_end >= 0 else []
