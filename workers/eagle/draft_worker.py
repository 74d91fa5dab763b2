"""The draft worker with an EAGLE head for a model: the draft worker's trees, fed the target's features.

Everything about scratch layouts, commits, laws and streams is the draft worker's (workers/draft_worker.py);
this adds what a head needs and a draft model does not:

- **features**: row j of a call reads the target's hidden state at position j - 1 for a token the target has
  verified (the in-flight tokens; from the ``FeatureStore`` the target fills), and the head's own output at its
  parent for a drafted node;
- **no drafted KV is kept**: a drafted node's head KV was computed from the head's own feature, not the
  target's, so after verification the accepted tokens are fed again as in-flight tokens with the target's
  features (as vLLM does); every tree reports ``kv_depth`` 0;
- **EAGLE-2 dynamic trees** (``eagle_topk`` > 0): the round's branching gives the depth D and the node budget N
  (``branching_nodes``); every expanded node proposes its ``eagle_topk`` most likely tokens, the ``eagle_topk``
  children with the highest path probability are expanded at the next depth, and the N most probable nodes of
  all form the tree. Children are chosen, not drawn: their law q is one-hot (docs/architecture.md), which keeps
  every temperature exact; a chain (``eagle_topk`` 0) samples and records the head's softmax like a draft model.

Pipelining would need features of round r before the target has made them; it is refused by the config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from scheduler.spec_policy import branching_nodes
from workers.distributed import TPGroup
from workers.draft_worker import DraftWorker, _Request, _Tree
from workers.eagle.features import FeatureStore, SeqFeatures
from workers.eagle.head import load_head
from workers.input_batch import SeqForward
from workers.law_channel import DraftLaws
from workers.messages import DraftStep, DraftStepOutput, DraftTree
from workers.model_config import ModelConfig, parse_dtype
from workers.model_runner import ModelRunner
from workers.q8_weights import hold_as_q8
from workers.worker_config import WorkerConfig


@dataclass
class _SeqFeed:
    """One sequence's features during a call: the target's for its in-flight tokens, its own per scratch node."""

    target: torch.Tensor  # [u, H] fused
    own: dict[int, torch.Tensor] = field(default_factory=dict)  # scratch index -> [H] head output (prenorm)

    def of(self, node: int, parent: int) -> torch.Tensor:
        return self.target[node] if node < self.target.shape[0] else self.own[parent]


class EagleDraftWorker(DraftWorker):
    def __init__(self, config: WorkerConfig, tp: TPGroup | None = None) -> None:
        # Not WorkerBase.__init__: the model is a head (workers/eagle/head.py), not a checkpoint load_model knows.
        self.config = config
        self.tp = tp or TPGroup.single()
        if self.tp.size > 1:
            raise ValueError("an EAGLE head runs on one draft rank: draft_tensor_parallel_size must be 1")
        if config.eagle_target is None or config.eagle_target_config is None:
            raise ValueError("an EAGLE draft worker needs its target (WorkerConfig.eagle_target / _config)")
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_dict(config.eagle_target_config)  # ids live in the target's vocab
        dtype = parse_dtype(config.dtype, torch.float32) if config.dtype else torch.float32
        self.head = self.model = load_head(config.model, config.eagle_target, self.model_config, dtype, self.device)
        if config.quantization == "q8_0":
            hold_as_q8(self.head)  # its matrices as Q8_0 blocks (workers/q8_weights.py)
        hc = self.head.head_config
        self.runner = ModelRunner(self.head, 1, hc.num_kv_heads, hc.head_dim, config.num_blocks, config.block_size,
                                  dtype, self.device)
        self.aux_layers = hc.aux_layers(self.model_config.num_layers)  # what the target must capture
        self.features = FeatureStore()  # filled by the target (``TargetWorker.feed_eagle``)
        self._feeds: dict[int, _SeqFeed] = {}  # id(block table) -> its call's features
        self._scratch = {}
        self._marks = []
        self._next_tree_id = 0
        self.law_sink = None
        self.vocab_map = None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _own_ids(self, tokens: list[int]) -> list[int]:
        return tokens  # the head embeds the target's whole vocabulary

    @torch.inference_mode()
    def step(self, msg: DraftStep) -> DraftStepOutput:
        self._feeds = {}
        width = self.head.head_config.feature_size
        for p in msg.prefills:
            # The engine prefills a head lazily (with the first round) and has the target recompute a replaced
            # head's requests (LLMEngine.resume_draft); a prefix sent anyway has no features here: it is fed zeros.
            # The head drafts worse for it; what is accepted, and so the output, stays the target's.
            zeros = torch.zeros(len(p.token_ids), width, device=self.device)  # [n, F]
            self.features.put([SeqFeatures(p.seq_id, p.base_len, zeros.cpu())])
            self._feeds[id(p.block_table)] = _SeqFeed(self.head.fuse(zeros))
        for s in msg.seqs:
            if s.pred_tokens or s.guesses or s.anchors != [-1]:
                raise ValueError("EAGLE drafting does not pre-draft (pipelining): it needs the verified features")
            aux = self.features.take(s.seq_id, s.base_len - 1, s.base_len + len(s.token_ids) - 1, width,
                                     self.device)  # [u, F]
            self._feeds[id(s.block_table)] = _SeqFeed(self.head.fuse(aux))
        try:
            return super().step(msg)
        finally:
            self._feeds = {}

    def _forward(self, pieces: list[SeqForward]) -> torch.Tensor:
        self._marks.append(time.perf_counter())
        feats: list[torch.Tensor] = []
        for p in pieces:
            feed = self._feeds[id(p.block_table)]
            feats += [feed.of(j, p.parents[j]) for j in range(p.new_start, len(p.parents))]
        self.head.features = torch.stack(feats) if feats else None  # [T, H]
        logits = self.runner.forward(pieces)  # [rows, V]
        out = self.head.prenorm  # [T, H]
        row = 0
        for p in pieces:
            feed = self._feeds[id(p.block_table)]
            for j in range(p.new_start, len(p.parents)):
                feed.own[j] = out[row]
                row += 1
        self.head.features = self.head.prenorm = None
        return logits

    def _grow(self, reqs: list[_Request], at: list[dict[int, torch.Tensor]]) -> None:
        if self.config.eagle_topk > 0:
            self._grow_dynamic(reqs, at)
        else:
            super()._grow(reqs, at)

    def _finish(self, seq_id: int, t: _Tree, depth: int, laws: list[DraftLaws]) -> DraftTree:
        tree = super()._finish(seq_id, t, depth, laws)
        tree.kv_depth = 0  # drafted nodes' KV came from the head's own features: fed again with the target's
        return tree

    def _grow_dynamic(self, reqs: list[_Request], at: list[dict[int, torch.Tensor]]) -> None:
        """EAGLE-2: expand the most probable nodes depth by depth (one forward per depth for the batch), then
        keep the budget's most probable nodes (ties: the earlier node), which always include their ancestors."""
        k = self.config.eagle_topk
        grow = [_Dynamic(r, at[i][r.trees[0].root], k) for i, r in enumerate(reqs)]
        for d in range(max((len(r.seq.branching) for r in reqs), default=0)):
            live = [g for g in grow if d < g.depth]
            for g in live:
                g.expand()
            live = [g for g in live if d + 1 < g.depth]
            if not live:
                break
            pieces = [g.beam_piece() for g in live]
            logits = self._forward(pieces)  # [sum of beams, V]
            row = 0
            for g, p in zip(live, pieces, strict=True):
                g.rows = list(logits[row: row + len(p.logit_nodes)])
                row += len(p.logit_nodes)
        for g in grow:
            g.select(self.vocab_size, self.device)


@dataclass
class _Dynamic:
    """One request's EAGLE-2 tree while it grows: candidates with their path log-probability."""

    r: _Request
    root_logits: torch.Tensor  # [V] at the anchor
    k: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # candidate index, -1: the anchor
    scores: list[float] = field(default_factory=list)
    scratch: dict[int, int] = field(default_factory=dict)  # candidate -> its scratch index once forwarded
    frontier: list[int] = field(default_factory=lambda: [-1])
    rows: list[torch.Tensor] = field(default_factory=list)
    _fresh: list[int] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.r.seq.branching)

    @property
    def budget(self) -> int:
        return branching_nodes(self.r.seq.branching)

    def expand(self) -> None:
        """Top-k children of every frontier node; the top-k of them by path score become the next frontier."""
        rows = self.rows or [self.root_logits]
        self._fresh = []
        for node, logits in zip(self.frontier, rows, strict=True):
            logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
            top = logp.topk(min(self.k, logp.shape[0]))
            base = self.scores[node] if node >= 0 else 0.0
            for tok, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if lp == float("-inf"):
                    break
                self._fresh.append(len(self.tokens))
                self.tokens.append(tok)
                self.parents.append(node)
                self.scores.append(base + lp)
        # Forwarded nodes live in the draft's scratch: never more than the round reserved (its node budget).
        beam = min(self.k, max(1, self.budget // max(self.depth - 1, 1)))
        self.frontier = sorted(self._fresh, key=lambda c: (-self.scores[c], c))[:beam]

    def beam_piece(self) -> SeqForward:
        r = self.r
        first = len(r.parents)
        for c in self.frontier:
            self.scratch[c] = len(r.parents)
            p = self.parents[c]
            r.parents.append(r.trees[0].root if p < 0 else self.scratch[p])
        return SeqForward(r.seq.block_table, r.seq.base_len, list(r.parents), [self.tokens[c] for c in self.frontier],
                          new_start=first, logit_nodes=list(range(first, len(r.parents))))

    def select(self, vocab: int, device: torch.device) -> None:
        """The budget's most probable candidates, in depth order, as the request's one tree."""
        keep = sorted(sorted(range(len(self.tokens)), key=lambda c: (-self.scores[c], c))[: self.budget])
        depth = {}
        for c in keep:  # candidates are created depth by depth: a parent precedes its children
            depth[c] = 0 if self.parents[c] < 0 else depth[self.parents[c]] + 1
        keep.sort(key=lambda c: (depth[c], c))
        new = {c: i for i, c in enumerate(keep)}
        t = self.r.trees[0]
        t.tokens = [self.tokens[c] for c in keep]
        t.parents = [-1 if self.parents[c] < 0 else new[self.parents[c]] for c in keep]
        t.scratch = []
        if not self.r.seq.sampling.greedy:  # chosen, not drawn: one-hot laws
            eye = torch.zeros(len(keep), vocab, device=device)
            eye[torch.arange(len(keep)), torch.tensor(t.tokens, dtype=torch.long)] = 1.0
            t.laws = list(eye.unbind(0))

