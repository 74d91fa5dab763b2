"""The draft worker: keeps the draft model's own cache and proposes candidate trees.

One call for one request lays out a scratch tree after the committed prefix:

    [in-flight tokens (a chain)] [prediction nodes (pipelining only)] [guess nodes] [one tree per anchor]

First forward: the in-flight chain and the prediction nodes (logits at every anchor and guess point). Guess
nodes (the draft's most likely tokens at a point, for pipelining) take one more forward. Then every anchor's
tree grows one depth at a time; depth d's nodes are forwarded to get q for depth d+1, the deepest level never
is. Every node records the law it was actually drawn from, which is what verification needs for the invariant.

An ordinary round has no predictions and a single anchor: the last in-flight token.

The layout stays here: the worker remembers each sequence's last scratch pad, and a later ``DraftCommit``
names the nodes to keep (in-flight tokens, prediction nodes, first-tree nodes); this worker turns them into
scratch slots. The controller sees trees as ints; their laws go to the verifier under a tree id
(workers/law_channel.py).

Randomness: the tree below an anchor draws from a generator seeded by (request seed, prefix length at the
anchor). A tree pre-drafted for a predicted prefix is then exactly the tree a later call would draft for that
same prefix, so pipelining changes no output, and no draw is ever shared with the verifier's stream.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.grammar_draft import DraftGrammarMasks
from workers.input_batch import SeqForward
from workers.law_channel import DraftLaws
from workers.messages import (
    CommitSpec,
    DraftCommit,
    DraftResult,
    DraftSeq,
    DraftStep,
    DraftStepOutput,
    DraftTree,
    SamplingSpec,
)
from workers.outcome_choice import choose_outcomes
from workers.proposal import ProposalMode, draw_children
from workers.sampling import logits_to_probs
from workers.streams import stream
from workers.tree_topology import most_probable_path, node_depths, scratch_parents
from workers.verification import pad_draft_probs
from workers.vocab_map import DraftVocabMap
from workers.worker_base import WorkerBase, prefill_forward, sampling_batch


@dataclass
class _Tree:
    """One anchor's tree while it is being drafted."""

    root: int  # scratch index of the anchor
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # tree parent indices (-1: the anchor)
    scratch: list[int] = field(default_factory=list)  # scratch index of each tree node once forwarded
    laws: list[torch.Tensor] = field(default_factory=list)  # [V] per node (sampled requests only); i.i.d.
    #                                                        siblings share their parent's law object
    frontier: list[int] = field(default_factory=lambda: [-1])  # tree nodes expanded next (-1: the anchor)

    def scratch_of(self, node: int) -> int:
        return self.root if node < 0 else self.scratch[node]

    def path(self, node: int) -> list[int]:
        """The tokens from below the anchor down to ``node`` (-1: none)."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


@dataclass
class _Request:
    seq: DraftSeq
    parents: list[int]  # scratch parents: in-flight chain, prediction nodes, guesses, forwarded tree nodes
    tokens: list[int]
    pred_tokens: list[int]
    pred_parents: list[int]
    anchors: list[int]
    trees: list[_Tree] = field(default_factory=list)
    matcher: object = None  # a grammar request's llguidance matcher at the anchor (workers/grammar_draft.py)

    @property
    def u(self) -> int:
        return len(self.seq.token_ids)

    def pred_scratch(self, pred: int) -> int:
        """Scratch index of prediction node ``pred`` (-1: the last in-flight token)."""
        return self.u - 1 if pred < 0 else self.u + pred


@dataclass
class _Scratch:
    """Where a sequence's last call put its nodes: what a later DraftCommit is resolved against."""

    block_table: list[int]
    base_len: int
    num_inflight: int
    num_pred: int
    tree_slots: list[int]  # scratch index of the first tree's forwarded nodes

    def slots(self, c: DraftCommit) -> list[int]:
        if c.num_inflight > self.num_inflight or (c.nodes and c.num_inflight != self.num_inflight):
            raise ValueError(f"commit of sequence {c.seq_id} keeps {c.num_inflight} of {self.num_inflight} "
                             "in-flight tokens and then nodes: only a whole chain has nodes below it")
        path = list(range(c.num_inflight))
        for n in c.nodes:
            if n < self.num_pred:
                path.append(self.num_inflight + n)
            elif n - self.num_pred < len(self.tree_slots):
                path.append(self.tree_slots[n - self.num_pred])
            else:
                raise ValueError(f"commit of sequence {c.seq_id}: node {n} has no draft KV")
        return path


class DraftWorker(WorkerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._scratch: dict[int, _Scratch] = {}
        self._marks: list[float] = []  # start of each forward of the current step (perf_counter)
        self._next_tree_id = 0  # the same on every rank: each rank drafts the same trees
        # Where the laws of sampled trees go (the verifier's LawStore, or a socket to it); None: nowhere (ranks
        # other than 0).
        self.law_sink: Callable[[list[DraftLaws]], None] | None = None
        # A trimmed-vocabulary draft (workers/vocab_map.py): its rows are mapped to full-vocabulary ids right
        # after every forward, so everything below sees full-vocabulary logits with -inf off the map.
        self.vocab_map = DraftVocabMap.load(self.config.model)
        if self.vocab_map is not None and self.vocab_map.size != self.model_config.vocab_size:
            raise ValueError(f"{self.config.model}: the vocabulary map has {self.vocab_map.size} ids but the model "
                             f"has {self.model_config.vocab_size} rows")

    @functools.cached_property
    def grammars(self) -> DraftGrammarMasks:
        """Grammar requests' matchers (workers/grammar_draft.py), at first use (an EAGLE head's worker too)."""
        return DraftGrammarMasks(self.config.tokenizer or self.config.eagle_target or self.config.model,
                                 self.vocab_size)

    @property
    def vocab_size(self) -> int:
        if self.vocab_map is not None:
            return self.config.target_vocab_size or self.vocab_map.target_vocab_size
        return self.config.target_vocab_size or self.model_config.vocab_size

    def _forward(self, pieces: list[SeqForward]) -> torch.Tensor:
        """The draft's logits at the pieces' logit nodes: [rows, Vd], or [rows, Vt] for a mapped draft."""
        self._marks.append(time.perf_counter())  # each forward's segment runs to the next one's start
        if self.vocab_map is None:
            return self.runner.forward(pieces)
        # Every token fed to a mapped draft (prefix, in-flight, predicted, tree nodes) is a full-vocabulary id.
        local = [dataclasses.replace(p, token_ids=self.vocab_map.to_local(p.token_ids)) for p in pieces]
        return self.vocab_map.to_full(self.runner.forward(local))  # [rows, draft rows] -> [rows, Vt]

    def drop(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self._scratch.pop(s, None)
        self.grammars.drop(seq_ids)

    def _commit(self, commits: list[DraftCommit]) -> None:
        specs = []
        for c in commits:
            sc = self._scratch.pop(c.seq_id)
            specs.append(CommitSpec(sc.block_table, sc.base_len, sc.slots(c)))
        self.runner.commit(specs)

    @torch.inference_mode()
    def step(self, msg: DraftStep) -> DraftStepOutput:
        start = time.perf_counter()
        self._marks = []
        self.drop(msg.finished)
        self._commit(msg.commits)
        reqs = [self._layout(s) for s in msg.seqs]

        # Forward 1: prefills, every in-flight chain and prediction nodes; logits where trees or guesses start.
        pieces = [prefill_forward(dataclasses.replace(p, token_ids=self._own_ids(p.token_ids)))
                  for p in msg.prefills]
        wanted: list[list[int]] = []
        for r in reqs:
            points = sorted({r.pred_scratch(a) for a in r.anchors} | {r.pred_scratch(g.at) for g in r.seq.guesses})
            wanted.append(points)
            pieces.append(SeqForward(r.seq.block_table, r.seq.base_len, list(r.parents), list(r.tokens),
                                     logit_nodes=points))
        logits = self._forward(pieces)  # [sum of points, Vd]
        at: list[dict[int, torch.Tensor]] = []
        row = 0
        for points in wanted:
            at.append({p: logits[row + i] for i, p in enumerate(points)})
            row += len(points)

        # Forward 2 (pipelining only): the guessed tokens become anchors and need their own logits.
        guessed = [(r, rows) for r, rows in zip(reqs, at, strict=True) if r.seq.guesses]
        if guessed:
            pieces = [self._add_guesses(r, rows) for r, rows in guessed]
            logits = self._forward(pieces)  # [guess nodes, Vd]
            row = 0
            for (_, rows), piece in zip(guessed, pieces, strict=True):
                for j in piece.logit_nodes:
                    rows[j] = logits[row]
                    row += 1

        for r in reqs:
            depths = node_depths(r.parents)
            for a in r.anchors:
                root = r.pred_scratch(a)
                # Tokens the tree below this anchor conditions on: committed + the path down to the anchor.
                gen = self._stream(r.seq.sampling, r.seq.base_len + depths[root] + 1)
                r.trees.append(_Tree(root=root, generator=gen))
        self._grow(reqs, at)
        marks = [*self._marks, time.perf_counter()]
        forward_s = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        results, laws = [], []
        for r in reqs:
            trees = [self._finish(r.seq.seq_id, t, len(r.seq.branching), laws) for t in r.trees]
            results.append(DraftResult(r.seq.seq_id, r.pred_tokens, r.pred_parents, r.anchors, trees))
            self._scratch[r.seq.seq_id] = _Scratch(r.seq.block_table, r.seq.base_len, r.u, len(r.pred_tokens),
                                                   r.trees[0].scratch if r.trees else [])
        if laws and self.law_sink is not None:
            self.law_sink(laws)  # before the reply: the verifier may already be waiting for them
        return DraftStepOutput(results, time.perf_counter() - start, forward_s)

    def _layout(self, s: DraftSeq) -> _Request:
        parents = scratch_parents(len(s.token_ids), s.pred_parents)
        r = _Request(s, parents, self._own_ids(s.token_ids) + list(s.pred_tokens), list(s.pred_tokens),
                     list(s.pred_parents), list(s.anchors))
        if s.grammar is not None:  # kept in step every round; masks only a lone tree below the last token
            m = self.grammars.matcher(s.seq_id, s.grammar)
            r.matcher = m if s.anchors == [-1] and not s.pred_tokens and not s.guesses else None
        return r

    def _own_ids(self, tokens: list[int]) -> list[int]:
        """Target tokens the draft's vocabulary lacks (a draft vocabulary may be a prefix of the target's) are
        fed as id 0 (a mapped draft's ids are mapped in ``_forward``, to its fallback row): the draft's guesses
        get worse there, verification keeps the output exact."""
        if self.vocab_map is not None:
            return tokens
        v = self.model_config.vocab_size
        return [t if t < v else 0 for t in tokens]

    def _add_guesses(self, r: _Request, rows: dict[int, torch.Tensor]) -> SeqForward:
        first = len(r.parents)
        new: list[int] = []
        if r.seq.outcome_budget > 0:  # by expected value over every guess point
            gs = r.seq.guesses
            chosen = choose_outcomes([rows[r.pred_scratch(g.at)] for g in gs], [g.weight for g in gs],
                                     [g.exclude for g in gs], r.seq.sampling.temperature, r.seq.outcome_budget,
                                     r.seq.outcome_min_value)
            picks = [(gs[i].at, tok) for i, tok, _ in chosen]
        else:
            picks = []
            for g in r.seq.guesses:
                scores = rows[r.pred_scratch(g.at)].clone()  # [Vd] raw draft logits at the guess point
                if g.exclude:
                    scores[torch.tensor(g.exclude, dtype=torch.long, device=scores.device)] = float("-inf")
                picks += [(g.at, tok) for tok in scores.topk(min(g.count, scores.shape[0])).indices.tolist()]
        for at, tok in picks:
            r.pred_tokens.append(tok)
            r.pred_parents.append(at)
            r.anchors.append(len(r.pred_tokens) - 1)
            r.parents.append(r.pred_scratch(at))
            r.tokens.append(tok)
            new.append(tok)
        return SeqForward(r.seq.block_table, r.seq.base_len, list(r.parents), new, new_start=first,
                          logit_nodes=list(range(first, len(r.parents))))

    def _stream(self, spec: SamplingSpec, prefix_len: int) -> torch.Generator | None:
        return stream(spec, self.config.draft_seed_salt, prefix_len, self.device)

    def _grow(self, reqs: list[_Request], at: list[dict[int, torch.Tensor]]) -> None:
        """Grow every anchor's tree depth by depth; one forward per depth over all requests."""
        # rows[i]: logits for each frontier node of each tree of request i, in (tree, frontier) order.
        rows = [[at[i][t.root] for t in r.trees] for i, r in enumerate(reqs)]
        live = [i for i, r in enumerate(reqs) if r.trees]
        for d in range(max((len(r.seq.branching) for r in reqs), default=0)):
            live = [i for i in live if d < len(reqs[i].seq.branching)]
            if not live:
                break
            self._expand([reqs[i] for i in live], [rows[i] for i in live], d)
            live = [i for i in live if d + 1 < len(reqs[i].seq.branching)]
            if not live:
                break
            pieces = []
            for i in live:
                r = reqs[i]
                first = len(r.parents)
                toks: list[int] = []
                for t in r.trees:
                    for node in t.frontier:
                        t.scratch.append(len(r.parents))
                        r.parents.append(t.scratch_of(t.parents[node]))
                        toks.append(t.tokens[node])
                pieces.append(SeqForward(r.seq.block_table, r.seq.base_len, list(r.parents), toks, new_start=first,
                                         logit_nodes=list(range(first, len(r.parents)))))
            logits = self._forward(pieces)  # [sum of frontier sizes, Vd]
            row = 0
            for i, piece in zip(live, pieces, strict=True):
                n = len(piece.logit_nodes)
                rows[i] = list(logits[row: row + n])
                row += n

    def _expand(self, reqs: list[_Request], rows: list[list[torch.Tensor]], d: int) -> None:
        """Draw depth-d children for every frontier node of every tree."""
        flat = [x for rr in rows for x in rr]
        counts = [len(rr) for rr in rows]
        logits = torch.stack(flat)  # [rows, Vd]
        if any(r.matcher is not None for r in reqs):  # draw from the grammar-masked law; q is that law
            logits = self.grammars.mask(logits, [(r.matcher, t.path(p)) if r.matcher is not None else None
                                                 for r in reqs for t in r.trees for p in t.frontier])
        probs = None  # greedy requests take the top tokens and need no law (a sort over the vocabulary per row)
        if not all(r.seq.sampling.greedy for r in reqs):
            # Transforms on the draft's own vocabulary, then zeros for target ids it lacks: q must be the law the
            # children are actually drawn from.
            params = sampling_batch([r.seq.sampling for r in reqs], counts, logits.device)
            probs = pad_draft_probs(logits_to_probs(logits, params), self.vocab_size)  # [rows, V]
        iid = ProposalMode(self.config.tree_sampling) is ProposalMode.IID
        row = 0
        for r in reqs:
            width = r.seq.branching[d]
            for t in r.trees:
                new_frontier: list[int] = []
                for parent in t.frontier:
                    if r.seq.sampling.greedy:
                        # Greedy requests are verified by argmax matching, which needs no law: the draft's
                        # top tokens by raw logit are the best guesses of the target's argmax.
                        toks = logits[row].topk(min(width, logits.shape[1])).indices
                        if r.matcher is not None:  # fewer allowed tokens than children: no refused child
                            toks = toks[logits[row][toks] > float("-inf")]
                        laws = None
                    else:
                        toks, laws = draw_children(probs[row], width, self.config.tree_sampling, t.generator)
                        if iid and len(laws):
                            laws = [laws[0]] * len(laws)  # one law object: it crosses to the verifier once
                    for k, tok in enumerate(toks.tolist()):
                        new_frontier.append(len(t.tokens))
                        t.tokens.append(tok)
                        t.parents.append(parent)
                        if laws is not None:
                            t.laws.append(laws[k])
                    row += 1
                t.frontier = new_frontier

    def _finish(self, seq_id: int, t: _Tree, depth: int, laws: list[DraftLaws]) -> DraftTree:
        """The tree as ints; a sampled tree's laws are queued for the verifier under a new tree id."""
        scores = None
        tree_id = -1
        if t.laws:
            tree_id = self._next_tree_id
            self._next_tree_id += 1
            laws.append(DraftLaws.of(seq_id, tree_id, t.laws))
            scores = laws[-1].node_probs(t.tokens)  # q_i(x_i)
        return DraftTree(list(t.tokens), list(t.parents), tree_id, max(0, depth - 1),
                         most_probable_path(t.parents, scores))
