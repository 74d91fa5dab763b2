"""The self-draft call: what the controller asks the target's ranks to draft (ints only, like every message)."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.messages import DraftTree, SamplingSpec


@dataclass
class SelfDraftSeq:
    seq_id: int
    block_table: list[int]  # the target's: drafting writes the target's own scratch slots
    base_len: int  # tokens with committed target KV
    token_ids: list[int]  # the in-flight tokens (fed first)
    sampling: SamplingSpec
    num_tokens: int  # K: the tree's depth this round
    branching: list[int] = field(default_factory=list)  # children per node at each depth; empty: a chain of K


@dataclass
class SelfDraftStep:
    seqs: list[SelfDraftSeq] = field(default_factory=list)


@dataclass
class SelfDraftOutput:
    trees: list[DraftTree]  # one per seq, in order (tree_id: the laws' key in the target's law store, -1 greedy)
    elapsed_s: float
    # worker seconds per drafting forward, as the adaptive policy's cost model counts them (scheduler/adaptive/
    # costs.py: forward f makes depth f; the last pass, the deepest drafts' early layers only, is in the last one)
    forward_s: list[float] = field(default_factory=list)
    laws_error: None = None  # never set: read by the executors' ``wait_target``, which carries this call too
