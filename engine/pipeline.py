"""Pipelined speculation: the draft drafts round r+1 while the target verifies round r.

While round r's tree is verified, the draft predicts the round's outcome and pre-drafts round r+1's tree for
the ``width`` likeliest predicted outcomes in one call (a small speculation cache keyed by the predicted prefix).
Outcomes follow the draft's most probable path through the tree:

- rejection at depth j of that path, the draft's best token not among the children tried there standing in
  for the recovered token;
- full acceptance, then the draft's top tokens at the leaf as the bonus token.

Their likelihood comes from the acceptance rates measured so far (P(exactly j accepted) per depth), so a draft
that is rarely accepted pre-drafts for early rejections and a good draft for full acceptance.

When the real outcome arrives, a request whose real prefix equals a predicted one goes straight to the next
verification with that pre-drafted tree; the others are re-drafted from the real prefix before the next
verification (the draft keeps the KV of the longest predicted prefix that came true and forgets the rest).

Lossless: a pre-drafted tree is used only when its prefix equals the real one, and its draws come from the
stream keyed by that prefix (workers/draft_worker.py), so it is exactly the tree a re-draft would propose:
greedy and seeded outputs are identical with pipelining on and off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.messages import CommitSpec, DraftResult, DraftSeq, DraftStep, GuessSpec, PrefillSeq, SamplingSpec
from workers.verification import CandidateTree

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from scheduler.scheduler import ScheduledBatch


def sampling_spec(req) -> SamplingSpec:
    p = req.params
    return SamplingSpec(p.temperature, p.top_k, p.top_p, p.min_p, req.seed)


@dataclass
class PipelineStats:
    predrafted: int = 0  # rounds whose next tree was pre-drafted
    hits: int = 0  # ... and whose real outcome matched a prediction
    draft_busy_s: float = 0.0
    target_busy_s: float = 0.0
    draft_hidden_s: float = 0.0  # draft time that ran while the target was verifying
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "predrafted_rounds": self.predrafted,
            "hits": self.hits,
            "hit_rate": round(self.hits / self.predrafted, 4) if self.predrafted else 0.0,
            "draft_hidden_s": round(self.draft_hidden_s, 4),
            "draft_idle_s": round(max(0.0, self.wall_s - self.draft_busy_s), 4),
            "target_idle_s": round(max(0.0, self.wall_s - self.target_busy_s), 4),
            "wall_s": round(self.wall_s, 4),
        }


@dataclass
class _PreDraft:
    base_len: int  # draft KV committed before the in-flight chain
    chain: list[int]  # in-flight tokens at pre-draft time (scratch nodes 0..u-1)
    result: DraftResult


@dataclass
class Pipeliner:
    engine: LLMEngine
    width: int = 2  # predicted outcomes pre-drafted per request
    stats: PipelineStats = field(default_factory=PipelineStats)
    _ready: dict[int, CandidateTree] = field(default_factory=dict)  # seq_id -> next round's tree (a hit)
    _commits: dict[int, CommitSpec] = field(default_factory=dict)  # draft KV to keep, sent with the next call
    _inflight: dict[int, _PreDraft] = field(default_factory=dict)
    _t_submit: float = 0.0
    _t_target: float = 0.0
    _step_start: float = 0.0
    _predraft_sent: bool = False

    def forget(self, seq_id: int) -> None:
        self._ready.pop(seq_id, None)
        self._commits.pop(seq_id, None)
        self._inflight.pop(seq_id, None)

    # ---------------------------------------------------------------------------------------- before verify
    def trees_for(self, batch: ScheduledBatch, finished_ids: list[int]) -> list[CandidateTree]:
        """Hits use their pre-drafted tree; everything else is drafted now from the real prefix."""
        eng = self.engine
        self._step_start = time.perf_counter()
        trees: dict[int, CandidateTree] = {}
        misses = []
        for r in batch.rounds:
            depth = eng._depth(r)
            ready = self._ready.pop(r.seq_id, None)
            if depth == 0:
                continue
            if ready is not None:
                trees[r.seq_id] = prune_tree(ready, depth)
            else:
                misses.append(r)
        msg = DraftStep(commits=self._take_commits(), finished=finished_ids, prefills=[
            PrefillSeq(c.req.seq_id, eng._draft_table(c.req), c.start, c.req.all_token_ids[c.start:c.end])
            for c in batch.prefills])
        for r in misses:
            msg.seqs.append(DraftSeq(r.seq_id, eng._draft_table(r), r.num_cached_draft,
                                     r.all_token_ids[r.num_cached_draft:], sampling_spec(r),
                                     list(eng.tree.branching[: eng._depth(r)])))
        if msg.seqs or msg.prefills or msg.commits or msg.finished:
            eng.executor.submit_draft(msg)
            out = eng.executor.wait_draft()
            self.stats.draft_busy_s += out.elapsed_s
            eng.times.draft_s += out.elapsed_s
            trees.update({res.seq_id: res.trees[0] for res in out.results})
        return [trees.get(r.seq_id) or CandidateTree.empty(eng.vocab_size) for r in batch.rounds]

    # ---------------------------------------------------------------------------------------- during verify
    def predraft(self, batch: ScheduledBatch, trees: list[CandidateTree]) -> None:
        """Called right after the target call is submitted: start drafting round r+1 for predicted outcomes."""
        eng = self.engine
        self._t_submit = time.perf_counter()
        msg = DraftStep(commits=self._take_commits())
        for r, tree in zip(batch.rounds, trees, strict=True):
            # Round r+1 starts at most num_nodes + 1 tokens further on; skip it if it may pass the draft's context.
            if (tree.num_nodes == 0 or r.remaining_tokens <= 2
                    or r.num_tokens + tree.num_nodes + 1 + eng.tree.depth > eng.draft_max_len):
                continue
            # At least one in-flight token: re-feeding the last committed one is harmless (same KV).
            base = min(r.num_cached_draft, r.num_tokens - 1)
            chain = r.all_token_ids[base:]
            seq = DraftSeq(r.seq_id, eng._draft_table(r), base, chain, sampling_spec(r), list(eng.tree.branching),
                           anchors=[])
            self._predict(seq, tree)
            msg.seqs.append(seq)
            self._inflight[r.seq_id] = _PreDraft(base, chain, None)  # result filled in by collect
        if msg.seqs or msg.commits:
            eng.executor.submit_draft(msg)
            self._predraft_sent = True
        else:
            self._predraft_sent = False

    def _predict(self, seq: DraftSeq, tree: CandidateTree) -> None:
        path = most_probable_path(tree)
        children = children_lists(tree)
        toks = tree.tokens.tolist()
        for d, node in enumerate(path):
            seq.pred_tokens.append(toks[node])
            seq.pred_parents.append(d - 1)
        # at[d] = P(at least d tokens accepted); the bonus guesses split full acceptance 3:1 between the two.
        at = [1.0] + self._acceptance(len(path))
        outcomes = [(at[d] - at[d + 1], d, 0) for d in range(len(path))]  # rejected at depth d
        outcomes += [(at[-1] * 0.75, len(path), 0), (at[-1] * 0.25, len(path), 1)]  # full, 1st/2nd bonus guess
        chosen = sorted(outcomes, key=lambda o: -o[0])[: self.width]
        for d in sorted({d for _, d, _ in chosen}):
            count = sum(1 for _, dd, _ in chosen if dd == d)
            if d == len(path):
                seq.guesses.append(GuessSpec(at=d - 1, count=count))
            else:
                tried = children[path[d - 1] + 1] if d > 0 else children[0]
                seq.guesses.append(GuessSpec(at=d - 1, count=count, exclude=[toks[c] for c in tried]))

    def _acceptance(self, depth: int) -> list[float]:
        """P(at least d accepted) for d = 1..depth: measured, or a prior of 0.7 per token before any round."""
        stats = self.engine.stats
        if stats.num_rounds < 8:
            return [0.7 ** d for d in range(1, depth + 1)]
        rates = stats.acceptance_per_position
        return [rates[d - 1] if d - 1 < len(rates) else 0.0 for d in range(1, depth + 1)]

    # ---------------------------------------------------------------------------------------- after verify
    def target_done(self, elapsed_s: float) -> None:
        self._t_target = time.perf_counter()
        self.stats.target_busy_s += elapsed_s

    def collect(self, batch: ScheduledBatch) -> None:
        """Wait for the pre-draft, match it against the real outcomes, keep what came true."""
        eng = self.engine
        if self._predraft_sent:
            out = eng.executor.wait_draft()
            self.stats.draft_busy_s += out.elapsed_s
            self.stats.draft_hidden_s += min(out.elapsed_s, self._t_target - self._t_submit)
            for res in out.results:
                if res.seq_id in self._inflight:
                    self._inflight[res.seq_id].result = res
        for r in batch.rounds:
            pre = self._inflight.pop(r.seq_id, None)
            if pre is None or pre.result is None or r.finished:
                continue
            self.stats.predrafted += 1
            kept, tree = match_prediction(pre.chain, pre.result, r.all_token_ids[pre.base_len:])
            self._commits[r.seq_id] = CommitSpec(eng._draft_table(r), pre.base_len, kept)
            r.num_cached_draft = pre.base_len + len(kept)
            if tree is not None:
                self.stats.hits += 1
                self._ready[r.seq_id] = tree
        self.stats.wall_s += time.perf_counter() - self._step_start

    def _take_commits(self) -> list[CommitSpec]:
        commits = list(self._commits.values())
        self._commits.clear()
        return commits


def most_probable_path(tree: CandidateTree) -> list[int]:
    """Root to leaf, taking at each node the child the draft gave the most mass (greedy trees: the first)."""
    children = children_lists(tree)
    laws = tree.draft_probs
    toks = tree.tokens.tolist()
    path: list[int] = []
    slot = 0
    while children[slot]:
        kids = children[slot]
        if laws.shape[1] == 0:
            best = kids[0]  # greedy trees list the draft's top tokens first
        else:
            best = max(kids, key=lambda c: float(laws[c, toks[c]]))
        path.append(best)
        slot = best + 1
    return path


def children_lists(tree: CandidateTree) -> list[list[int]]:
    """children[0]: the root's children; children[i + 1]: node i's, in drawn order."""
    out: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]
    for i, p in enumerate(tree.parents.tolist()):
        out[p + 1].append(i)
    return out


def match_prediction(chain: list[int], res: DraftResult, real: list[int]) -> tuple[list[int], CandidateTree | None]:
    """Scratch nodes whose draft KV is valid for the real tokens, and the pre-drafted tree if one fits exactly.

    Scratch layout: the in-flight chain (nodes 0..u-1), then the prediction nodes (u + i).
    """
    u = len(chain)
    kept: list[int] = []
    for i, tok in enumerate(chain):
        if i >= len(real) or real[i] != tok:
            return kept, None
        kept.append(i)
    node = -1  # the last in-flight token
    for tok in real[u:]:
        nxt = next((i for i, (t, p) in enumerate(zip(res.pred_tokens, res.pred_parents, strict=True))
                    if p == node and t == tok), None)
        if nxt is None:
            return kept, None
        kept.append(u + nxt)
        node = nxt
    if node in res.anchors:
        return kept, res.trees[res.anchors.index(node)]
    return kept, None


def prune_tree(tree: CandidateTree, max_depth: int) -> CandidateTree:
    """The nodes at depth < max_depth (a tree pre-drafted deeper than the request may still go)."""
    parents = tree.parents.tolist()
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    keep = [i for i, d in enumerate(depth) if d < max_depth]
    if len(keep) == len(parents):
        return tree
    index = {old: new for new, old in enumerate(keep)}
    idx = torch.tensor(keep, dtype=torch.long)
    new_parents = torch.tensor([-1 if parents[i] < 0 else index[parents[i]] for i in keep], dtype=torch.long)
    probs = tree.draft_probs[idx] if tree.draft_probs.shape[1] else tree.draft_probs[: len(keep)]
    return CandidateTree(tokens=tree.tokens[idx], parents=new_parents, draft_probs=probs)
