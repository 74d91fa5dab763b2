"""Typed messages between the controller and the workers (plain ints and floats: they cross processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.sampling_params import is_greedy

# A tree_id saying the tree's laws are one-hot at its own tokens (deterministic proposals: n-gram, suffix), so
# the verifier builds them from the ints at any temperature (the deterministic-children rule) and no law travels.
ONE_HOT_TREE = -2


@dataclass
class SamplingSpec:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    logprobs: int = -1  # >= 0: return each emitted token's logprob and this many top alternatives (-1: none)
    logprobs_mode: str = "raw_logprobs"  # scheduler/sampling_params.py LOGPROBS_MODES

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


@dataclass
class PrefillSeq:
    seq_id: int
    block_table: list[int]
    base_len: int  # tokens already cached
    token_ids: list[int]  # the chunk
    sample: SamplingSpec | None = None  # set on the chunk that ends a fresh prompt: sample the first token
    # >= 0: the logprobs of the prompt tokens after each of the chunk's positions (echo), with this many top
    # alternatives; next_token is the prompt token after the chunk (-1: the chunk ends the prompt).
    prompt_logprobs: int = -1
    next_token: int = -1
    allowed: Any = None  # [1, ceil(V / 32)] int32: a grammar's packed mask for the first token (grammar_mask.py)


@dataclass
class CommitSpec:
    """Inside a worker: move scratch nodes ``path`` down to positions base_len, base_len + 1, ... of the sequence."""

    block_table: list[int]
    base_len: int
    path: list[int]


@dataclass
class DraftCommit:
    """Which nodes of the draft's last call for a sequence hold KV for tokens that are now real.

    The draft worker knows where it put them (its scratch layout); the controller names them only: the first
    ``num_inflight`` in-flight tokens, then ``nodes``, numbered as in that call's DraftResult: its prediction
    nodes first, then the nodes of its first tree (node i at len(pred_tokens) + i).
    """

    seq_id: int
    num_inflight: int
    nodes: list[int] = field(default_factory=list)


@dataclass
class GuessSpec:
    """Pipelining: below scratch node ``at``, add the draft's ``count`` most likely tokens (not in ``exclude``)
    as predicted outcomes, each an anchor for a pre-drafted tree. ``at`` indexes the prediction nodes, -1 being
    the last in-flight token."""

    at: int
    count: int
    exclude: list[int] = field(default_factory=list)
    weight: float = 1.0  # P(the round in flight ends here): used when the seq has an outcome_budget


@dataclass
class DraftGrammar:
    """Keeps the draft worker's matcher of one request at its committed output (workers/grammar_draft.py)."""

    grammar: str  # the llguidance grammar: the request's first call (and after a drop) only, else ""
    start: int  # output tokens the worker's matcher has consumed before ``tokens``
    tokens: list[int]  # the committed output tokens since then


@dataclass
class DraftSeq:
    seq_id: int
    block_table: list[int]
    base_len: int  # tokens with committed draft KV
    token_ids: list[int]  # tokens the draft has not seen yet (the last one is the tree's root context)
    sampling: SamplingSpec
    branching: list[int]  # children per node at each depth
    # Pipelining (empty for an ordinary round): predicted tokens hanging below the in-flight tokens
    # (parents -1 = below the last in-flight token), guesses added by the worker, and the anchors (prediction
    # node indices, -1 = the last in-flight token) from which to draft a tree each.
    pred_tokens: list[int] = field(default_factory=list)
    pred_parents: list[int] = field(default_factory=list)
    guesses: list[GuessSpec] = field(default_factory=list)
    anchors: list[int] = field(default_factory=lambda: [-1])
    # > 0: the worker picks up to this many outcomes over all guess points by expected value (guess weight x the
    # draft's estimate of the next token's law, workers/outcome_choice.py), the best one always, further ones
    # only if worth at least outcome_min_value; each GuessSpec's count is then ignored.
    outcome_budget: int = 0
    outcome_min_value: float = 0.0
    grammar: DraftGrammar | None = None  # a grammar request's matcher update (workers/grammar_draft.py)


@dataclass
class DraftTree:
    """A drafted candidate tree as the controller sees it: ints only (its laws go to the verifier directly)."""

    tokens: list[int]
    parents: list[int]  # -1 = child of the anchor; nodes in depth order
    tree_id: int  # key of its laws on the law channel (workers/law_channel.py); -1: greedy, no laws; ONE_HOT_TREE
    kv_depth: int  # leading depths whose draft KV was written (the deepest level never is)
    likely_path: list[int]  # root to leaf through the child the draft gave the most mass (pipelining)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)


@dataclass
class DraftResult:
    seq_id: int
    pred_tokens: list[int]  # the prediction nodes, guesses appended
    pred_parents: list[int]
    anchors: list[int]  # one per tree: the given anchors, then every guess node
    trees: list[DraftTree]  # one per anchor


@dataclass
class DraftStepOutput:
    results: list[DraftResult]  # one per DraftSeq, same order
    elapsed_s: float = 0.0  # worker-side time of the whole step
    # worker-side seconds of each draft forward, in order, each with the drafting it feeds (sampling the next
    # level); the rest of elapsed_s is the call's own (commit, layout, results). Empty: not timed apart.
    forward_s: list[float] = field(default_factory=list)


@dataclass
class DraftStep:
    commits: list[DraftCommit] = field(default_factory=list)  # applied first, against each sequence's last call
    prefills: list[PrefillSeq] = field(default_factory=list)  # chunks to cache, no logits needed
    seqs: list[DraftSeq] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # seq ids finished or preempted: drop their state


@dataclass
class VerifySeq:
    seq_id: int
    block_table: list[int]
    base_len: int  # tokens with committed target KV
    token_ids: list[int]  # in-flight tokens (normally one: last round's recovered/bonus token)
    tree_tokens: list[int]
    tree_parents: list[int]
    sampling: SamplingSpec
    # The laws the candidates were drawn from reach the verifying rank from the draft directly, under this id
    # (the first len(tree_tokens) nodes of that tree); -1 for greedy requests (one-hot by construction);
    # ONE_HOT_TREE: every node's law is one-hot at its own token (deterministic proposals), built by the verifier.
    tree_id: int = -1
    # A grammar request's packed masks, one row per logits row (row 0 at the root, row i + 1 after node i):
    # [N + 1, ceil(V / 32)] int32 tensor, bit t of a row set = token t allowed (engine/structured/masks.py).
    allowed: Any = None


@dataclass
class TargetStep:
    prefills: list[PrefillSeq] = field(default_factory=list)
    seqs: list[VerifySeq] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)


@dataclass
class VerifyResult:
    """A verified round: the one result type, from verification to the scheduler and the statistics."""

    accepted_nodes: list[int]  # node indices of the accepted path, root to leaf (the KV commit uses them)
    tokens: list[int]  # the accepted tokens, then exactly one recovered or bonus token
    num_accepted: int  # len(accepted_nodes)
    bonus: bool  # True: the last token is a bonus (a leaf was reached); False: recovered


@dataclass
class TokenLogprobs:
    """Log-probabilities of T tokens of one sequence (workers/logprobs.py), only for requests that ask."""

    logprobs: list[float]  # [T] each token's own value
    top_ids: list[list[int]]  # [T][k] the k most likely ids at that position, most likely first
    top_logprobs: list[list[float]]  # [T][k] their values


@dataclass
class TargetStepOutput:
    first_tokens: dict[int, int]  # seq_id -> first generated token, for prefills that asked to sample
    results: list[VerifyResult]  # one per VerifySeq, same order
    elapsed_s: float = 0.0  # worker-side time of the whole step
    # Set when a tree's laws could not come (their draft died, or never sent them): nothing was verified or
    # committed past the in-flight tokens, ``results`` is empty, and the controller abandons the step.
    laws_error: str | None = None
    # seq_id -> the logprobs of the tokens it emitted this step (first token or round), when its spec asks
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    # seq_id -> the logprobs of its prefill chunk's prompt tokens after the chunk's first (PrefillSeq.prompt_logprobs)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)


@dataclass
class WorkerReply:
    """What a worker sends back for one call: the result, or the error that stopped it."""

    result: Any = None
    error: str | None = None  # formatted traceback from the worker
