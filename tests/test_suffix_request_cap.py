"""A running request's own suffix trie is bounded (``suffix_decoding_max_request_tokens``): it indexes exactly
the substrings of its last tokens, however long the request grows."""

from __future__ import annotations

import random

import pytest

from engine.core.config import SpeculativeConfig
from engine.drafting.draftless_config import SuffixConfig, suffix_config
from engine.drafting.suffix import SuffixProposer
from engine.drafting.suffix_tree import SuffixTrie


def test_a_long_requests_own_trie_stays_bounded_and_indexes_its_last_tokens() -> None:
    """5,000 tokens in rounds of 1-7, cap 300, depth 6: at most 300 x 6 nodes at every round (without the cap
    the trie reaches ~25,000 nodes: shown failing by skipping ``drop_oldest``), and the trie is the one a fresh
    trie over the last 300 tokens would be: every substring with the same count."""
    cap, depth, rng = 300, 6, random.Random(1)
    proposer = SuffixProposer(SuffixConfig(max_tree_depth=depth, min_token_prob=0.0, max_request_tokens=cap))
    tokens: list[int] = []
    while len(tokens) < 5000:
        tokens += [rng.randrange(20) for _ in range(rng.randint(1, 7))]
        proposer.propose(0, tokens, max_nodes=8, max_depth=4)
        assert proposer.own_nodes <= cap * depth
    fresh = SuffixTrie(depth)
    fresh.add(tokens[-cap:])
    assert proposer.own_nodes == fresh.num_nodes
    own = SuffixTrie(depth)
    own.append(tokens[:-cap])  # the same trie, grown and then cut in one go
    own.append(tokens[-cap:])
    own.drop_oldest(tokens, cap)
    assert _counts(own.root) == _counts(fresh.root)
    proposer.forget(0)
    assert proposer.own_nodes == 0


def _counts(node, prefix=()) -> dict[tuple[int, ...], int]:
    out = {}
    for t, c in (node.children or {}).items():
        out[prefix + (t,)] = c.count
        out.update(_counts(c, prefix + (t,)))
    return out


def test_the_cap_is_a_config_key_no_shorter_than_the_tree_depth() -> None:
    spec = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_request_tokens": 64})
    assert suffix_config(spec).max_request_tokens == 64
    assert suffix_config(SpeculativeConfig.parse({"method": "suffix"})).max_request_tokens == 8192
    with pytest.raises(ValueError, match="suffix_decoding_max_request_tokens"):
        SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_request_tokens": 8})  # < depth 24
