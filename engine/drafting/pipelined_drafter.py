"""Pipelined speculation: the draft drafts round r+1 while the target verifies round r.

One step, seen from this drafter (engine/drafting/drafter.py has the interface):

1. ``propose``: a request whose last round came out as predicted has its next tree ready (a *hit*); every
   other request is drafted now from its real prefix (a *miss*), in one draft call.
2. ``overlap``, right after the target call is submitted: predict each request's outcome and pre-draft round
   r+1's trees for the predicted outcomes worth most (at most ``width``), in one draft call that runs
   during verification.
3. ``commit``, once the target answered: wait for the pre-draft, match it against the real outcome, keep the
   draft KV of the longest predicted prefix that came true (sent with the next draft call) and the pre-drafted
   tree if its prefix is exactly the real one.

Predicted outcomes: a round ends (accepted length j, next token). The round in flight goes to the draft as
prediction nodes along its most probable path (``DraftTree.likely_path``), with one guess point per way it can
end — rejected at depth j (the next token off the children tried there) or all accepted (a bonus token) —
weighted by P(that j) from the acceptance rates measured so far. The draft worker, which has its q along the
path, estimates the next token's law there and pre-drafts the outcomes worth most, per request per round: the
best always, more while P(outcome) pays for the marginal cost of one more tree (``OutcomeCosts``, measured),
at most ``width`` (workers/outcome_choice.py).

Lossless: a pre-drafted tree is used only when its prefix equals the real one, and its draws come from the
stream keyed by that prefix (workers/draft_worker.py), so it is exactly the tree a re-draft would propose:
greedy and seeded outputs are identical with pipelining on and off.

The draft worker's scratch pad for a pre-draft holds the in-flight chain, then the prediction nodes, the
guess nodes and the trees; this file never needs to know where: a ``DraftCommit`` names in-flight tokens and
prediction nodes, and the worker finds them.

Where pipelining does not pay, a step runs sequential (engine/drafting/pipeline_switch.py chooses per step from measured
cost per token): ``overlap`` pre-drafts nothing, so the next step drafts every round from its real prefix, and
``commit`` keeps the re-draft's in-flight tokens and accepted nodes as ``SequentialDrafter`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.drafting.drafter import NO_TREE, DraftCalls, keep_drafted
from engine.drafting.pipeline_switch import PipelineSwitch, regime
from scheduler.scheduler import ScheduledBatch
from scheduler.spec_policy import TreeShape
from workers.messages import DraftCommit, DraftResult, DraftSeq, DraftStep, DraftTree, GuessSpec, TargetStepOutput
from workers.tree_topology import children_lists, prune_to_depth


@dataclass
class PipelineStats:
    predrafted: int = 0  # rounds whose next tree was pre-drafted
    hits: int = 0  # ... and whose real outcome matched a prediction
    outcomes: int = 0  # pre-drafted trees (outcomes prepared), over all pre-drafted rounds
    draft_busy_s: float = 0.0
    target_busy_s: float = 0.0
    draft_hidden_s: float = 0.0  # draft time that ran while the target was verifying
    wall_s: float = 0.0
    steps: int = 0  # steps with a speculative round
    pipelined_steps: int = 0  # ... that pre-drafted during verification (the rest ran sequential)
    # [pre-drafted rounds, hits] by the round's real outcome: accepted length ("4" = all of a K=4 chain, then a
    # bonus token) and by the request's temperature ("0" = greedy).
    by_position: dict[str, list[int]] = field(default_factory=dict)
    by_temperature: dict[str, list[int]] = field(default_factory=dict)

    def count(self, accepted: int, temperature: float, hit: bool) -> None:
        self.predrafted += 1
        self.hits += hit
        for table, key in ((self.by_position, str(accepted)),
                           (self.by_temperature, "0" if temperature < 1e-5 else f"{temperature:g}")):
            row = table.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += hit

    def as_dict(self) -> dict:
        def rates(table: dict[str, list[int]]) -> dict:
            return {k: {"rounds": n, "hits": h, "hit_rate": round(h / n, 4)}
                    for k, (n, h) in sorted(table.items(), key=lambda kv: float(kv[0]))}

        return {
            "predrafted_rounds": self.predrafted,
            "hits": self.hits,
            "hit_rate": round(self.hits / self.predrafted, 4) if self.predrafted else 0.0,
            "outcomes_per_round": round(self.outcomes / self.predrafted, 3) if self.predrafted else 0.0,
            "hit_rate_by_position": rates(self.by_position),
            "hit_rate_by_temperature": rates(self.by_temperature),
            "steps": self.steps,
            "pipelined_fraction": round(self.pipelined_steps / self.steps, 4) if self.steps else 0.0,
            "draft_hidden_s": round(self.draft_hidden_s, 4),
            "draft_idle_s": round(max(0.0, self.wall_s - self.draft_busy_s), 4),
            "target_idle_s": round(max(0.0, self.wall_s - self.target_busy_s), 4),
            "wall_s": round(self.wall_s, 4),
        }


HIDDEN_COST = 0.25  # the share of a pre-draft's time charged while it hides behind verification: it still
#                    competes for memory bandwidth (and, in a thread, the interpreter lock) with the target


@dataclass
class OutcomeCosts:
    """Measured costs for choosing how many outcomes to pre-draft: a hit saves a re-draft, one more pre-drafted
    outcome costs its marginal draft time (charged in full only when the pre-draft outlasts verification).

    Pre-draft time vs outcomes in the call is a decaying least-squares line t = a + b * n; the re-draft a hit
    saves is the re-draft call's time per sequence in it. ``min_value`` = marginal cost / saving: an outcome is
    worth pre-drafting if its probability of being the one used is at least that."""

    decay: float = 0.95
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sums of 1, n, t, n*n, n*t (decayed)
    _redraft_s: float | None = None  # per sequence
    _verify_s: float | None = None
    _seen: int = 0

    def observe_predraft(self, elapsed_s: float, outcomes: int) -> None:
        n = float(outcomes)
        self._s = [self.decay * v + x for v, x in zip(self._s, (1.0, n, elapsed_s, n * n, n * elapsed_s),
                                                       strict=True)]
        self._seen += 1

    def observe_redraft(self, elapsed_s: float, seqs: int) -> None:
        if seqs:
            self._redraft_s = _ewma(self._redraft_s, elapsed_s / seqs)

    def observe_verify(self, elapsed_s: float) -> None:
        self._verify_s = _ewma(self._verify_s, elapsed_s)

    def line(self) -> tuple[float, float]:
        """(a, b) of t = a + b * n; b from the mean alone while n has not varied."""
        s0, sn, st, snn, snt = self._s
        var = snn * s0 - sn * sn
        if s0 <= 0 or sn <= 0:
            return 0.0, 0.0
        b = (snt * s0 - sn * st) / var if var > 1e-9 * s0 * s0 else st / sn
        b = max(b, 0.0)
        return max(st / s0 - b * sn / s0, 0.0), b

    def min_value(self) -> float:
        if self._seen < 8 or not self._redraft_s or self._verify_s is None:
            return 0.0  # before measurements: the full budget
        a, b = self.line()
        s0, sn = self._s[0], self._s[1]
        exposed = a + b * sn / s0 > self._verify_s  # the typical pre-draft outlasts verification
        return (b if exposed else HIDDEN_COST * b) / self._redraft_s


def _ewma(old: float | None, new: float, keep: float = 0.9) -> float:
    return new if old is None else keep * old + (1 - keep) * new


@dataclass
class _PreDraft:
    base_len: int  # draft KV committed before the in-flight chain
    chain: list[int]  # in-flight tokens at pre-draft time
    branching: tuple[int, ...]  # of the pre-drafted trees
    result: DraftResult | None = None


@dataclass
class Match:
    """How much of a pre-draft came true: in-flight tokens, then prediction nodes; the tree if it fits exactly."""

    num_inflight: int
    pred_nodes: list[int]
    tree: DraftTree | None


def match_prediction(chain: list[int], res: DraftResult, real: list[int]) -> Match:
    """Match the real tokens (from the pre-draft's base on) against the in-flight chain, then down the
    prediction nodes; the pre-drafted tree counts only if the real prefix ends exactly on its anchor."""
    for i, tok in enumerate(chain):
        if i >= len(real) or real[i] != tok:
            return Match(i, [], None)
    nodes: list[int] = []
    node = -1  # the last in-flight token
    for tok in real[len(chain):]:
        nxt = next((i for i, (t, p) in enumerate(zip(res.pred_tokens, res.pred_parents, strict=True))
                    if p == node and t == tok), None)
        if nxt is None:
            return Match(len(chain), nodes, None)
        nodes.append(nxt)
        node = nxt
    tree = res.trees[res.anchors.index(node)] if node in res.anchors else None
    return Match(len(chain), nodes, tree)


def prune(tree: DraftTree, max_depth: int) -> DraftTree:
    """The nodes at depth < max_depth (a tree pre-drafted deeper than the request may still go): a prefix of the
    nodes, so the verifier takes the first rows of the tree's laws."""
    keep = prune_to_depth(tree.parents, max_depth)
    if keep == tree.num_nodes:
        return tree
    path = tree.likely_path[:max_depth]
    return DraftTree(tree.tokens[:keep], tree.parents[:keep], tree.tree_id, min(tree.kv_depth, max_depth), path)


@dataclass
class PipelinedDrafter:
    calls: DraftCalls
    tree: TreeShape
    draft_max_len: int  # the draft's context: no pre-draft that may pass it
    # The policy's acceptance: P(at least d accepted), d = 1 .. depth, for a greedy (True) or sampled request.
    reach: Callable[[bool, int], list[float]]
    width: int = 2  # predicted outcomes pre-drafted per request
    stats: PipelineStats = field(default_factory=PipelineStats)
    costs: OutcomeCosts = field(default_factory=OutcomeCosts)
    switch: PipelineSwitch = field(default_factory=PipelineSwitch)  # pipelined or sequential, per step
    _ready: dict[int, tuple[DraftTree, tuple[int, ...]]] = field(default_factory=dict)  # seq_id -> next round's
    #                                                                     tree (a hit) and its branching
    _commits: dict[int, DraftCommit] = field(default_factory=dict)  # draft KV to keep, sent with the next call
    _inflight: dict[int, _PreDraft] = field(default_factory=dict)
    _t_submit: float = 0.0
    _step_start: float = 0.0
    _predraft_sent: bool = False
    _redrafted: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (base_len, in-flight
    #                                                                 tokens) of this step's re-draft
    _mode: bool = True  # this step pre-drafts (pipelined) or not (sequential)
    _last_mode: bool = False  # the previous step's: a pipelined step is steady only after a pipelined one
    _regime: tuple[bool, int] = (False, 0)

    # ---------------------------------------------------------------------------------------- before verify
    def propose(self, batch: ScheduledBatch, gone: list[int]) -> list[DraftTree]:
        """Hits use their pre-drafted tree; everything else is drafted now from the real prefix."""
        self._step_start = time.perf_counter()
        self._redrafted.clear()
        self._regime = regime(any(not r.params.greedy for r in batch.rounds), len(batch.rounds))
        self._mode = self.switch.choose(self._regime)
        for s in gone:
            self._ready.pop(s, None)
            self._commits.pop(s, None)
            self._inflight.pop(s, None)
        trees: dict[int, DraftTree] = {}
        msg = DraftStep(finished=gone, prefills=self.calls.prefills(batch))
        for r, shape in zip(batch.rounds, batch.shapes, strict=True):
            ready = self._ready.pop(r.seq_id, None)
            if not shape:
                continue
            # A pre-drafted tree serves if the policy's shape is its top levels (a chain of K_max serves every
            # shorter chain); otherwise the round is re-drafted at the shape the scheduler reserved.
            if ready is not None and ready[1][: len(shape)] == tuple(shape):
                trees[r.seq_id] = prune(ready[0], len(shape))
            else:  # the draft may hold every token already (a prediction came true, its tree did not fit the
                #      shape): re-feed the last one, harmless (same KV), so the tree has a row to grow from
                base = min(r.num_cached_draft, r.num_tokens - 1)
                msg.seqs.append(self.calls.seq(r, base, list(shape)))
                self._redrafted[r.seq_id] = (base, r.num_tokens - base)
        if msg.seqs or msg.prefills or msg.finished:
            # Commits alone are no reason to wait for the draft: when every round hit they ride with the pre-draft.
            msg.commits = self._take_commits()
            out = self.calls.run(msg)
            self.stats.draft_busy_s += out.elapsed_s
            if msg.seqs and not msg.prefills:
                self.costs.observe_redraft(out.elapsed_s, len(msg.seqs))
            trees.update({res.seq_id: res.trees[0] for res in out.results})
        return [trees.get(r.seq_id, NO_TREE) for r in batch.rounds]

    # ---------------------------------------------------------------------------------------- during verify
    def overlap(self, batch: ScheduledBatch, trees: list[DraftTree]) -> None:
        """Start drafting round r+1 for the predicted outcomes of round r."""
        self._t_submit = time.perf_counter()
        self._predraft_sent = False
        if not self._mode:  # sequential: the next step drafts from the real prefixes (commits wait for it)
            return
        msg = DraftStep(commits=self._take_commits())
        for r, tree, shape in zip(batch.rounds, trees, batch.shapes, strict=True):
            # Round r+1 starts at most num_nodes + 1 tokens further on; skip it if it may pass the draft's context.
            if (tree.num_nodes == 0 or r.remaining_tokens <= 2
                    or r.num_tokens + tree.num_nodes + 1 + self.tree.depth > self.draft_max_len):
                continue
            # At least one in-flight token: re-feeding the last committed one is harmless (same KV).
            base = min(r.num_cached_draft, r.num_tokens - 1)
            # Pre-draft the configured tree if this round was a tree, else the longest chain: the policy's next
            # depth is not known yet, and any shorter chain is a prefix of it.
            branching = self.tree.branching if any(w > 1 for w in shape) else (1,) * self.tree.depth
            seq = self.calls.seq(r, base, list(branching), anchors=[])
            self._predict(seq, tree, r.params.greedy)
            msg.seqs.append(seq)
            self._inflight[r.seq_id] = _PreDraft(base, seq.token_ids, branching)  # result filled in by commit
        self._predraft_sent = bool(msg.seqs or msg.commits)
        if self._predraft_sent:
            self.calls.submit(msg)

    def _predict(self, seq: DraftSeq, tree: DraftTree, greedy: bool) -> None:
        """The round in flight as prediction nodes (its likely path), and one guess point per way it can end:
        rejected at depth d (the next token off the children tried there) or all accepted (a bonus token), each
        weighted by its measured probability; the worker picks the outcomes by expected value vs cost."""
        path = tree.likely_path
        children = children_lists(tree.parents)
        for d, node in enumerate(path):
            seq.pred_tokens.append(tree.tokens[node])
            seq.pred_parents.append(d - 1)
        if self.width == 0:
            return
        at = [1.0] + self.reach(greedy, len(path))  # at[d] = P(at least d tokens accepted)
        for d in range(len(path) + 1):
            weight = at[d] - at[d + 1] if d < len(path) else at[-1]
            tried = [] if d == len(path) else children[path[d - 1] + 1] if d > 0 else children[0]
            seq.guesses.append(GuessSpec(at=d - 1, count=0, exclude=[tree.tokens[c] for c in tried],
                                         weight=max(weight, 0.0)))
        seq.outcome_budget = self.width
        seq.outcome_min_value = self.costs.min_value()

    # ---------------------------------------------------------------------------------------- after verify
    def commit(self, batch: ScheduledBatch, trees: list[DraftTree], out: TargetStepOutput) -> dict[int, int]:
        """Wait for the pre-draft, match it against the real outcomes, keep what came true."""
        t_target = time.perf_counter()
        self.stats.target_busy_s += out.elapsed_s
        if self._predraft_sent:
            pre_out = self.calls.wait()
            self.stats.draft_busy_s += pre_out.elapsed_s
            self.stats.draft_hidden_s += min(pre_out.elapsed_s, t_target - self._t_submit)
            outcomes = sum(len(res.anchors) for res in pre_out.results)
            self.stats.outcomes += outcomes
            if pre_out.results:
                self.costs.observe_predraft(pre_out.elapsed_s, outcomes)
            self.costs.observe_verify(out.elapsed_s)
            for res in pre_out.results:
                if res.seq_id in self._inflight:
                    self._inflight[res.seq_id].result = res
        cached = {}
        for r, tree, res in zip(batch.rounds, trees, out.results, strict=True):
            pre = self._inflight.pop(r.seq_id, None)
            if pre is None and r.seq_id in self._redrafted:  # no pre-draft: the re-draft's scratch is the
                #   worker's last for this sequence; keep it as the sequential drafter does
                self._commits[r.seq_id], cached[r.seq_id] = keep_drafted(r.seq_id, *self._redrafted[r.seq_id],
                                                                         tree, res.accepted_nodes)
                continue
            if pre is None or pre.result is None:
                continue
            real = r.all_token_ids[pre.base_len:] + res.tokens  # the round's tokens are emitted after this
            m = match_prediction(pre.chain, pre.result, real)
            self.stats.count(res.num_accepted, r.params.temperature, m.tree is not None)
            self._commits[r.seq_id] = DraftCommit(r.seq_id, m.num_inflight, m.pred_nodes)
            cached[r.seq_id] = pre.base_len + m.num_inflight + len(m.pred_nodes)
            if m.tree is not None:
                self._ready[r.seq_id] = (m.tree, pre.branching)
        elapsed = time.perf_counter() - self._step_start
        self.stats.wall_s += elapsed
        if any(t.num_nodes for t in trees):
            self.stats.steps += 1
            self.stats.pipelined_steps += self._mode
            if not batch.prefills:  # a prompt chunk's time is mostly prefill: not a cost of either mode
                self.switch.observe(self._regime, self._mode, self._mode == self._last_mode, elapsed,
                                    sum(len(res.tokens) for res in out.results))
        self._last_mode = self._mode
        return cached

    def has_tree(self, seq_id: int) -> bool:
        """The request's next tree is pre-drafted (its last round came out as predicted)."""
        return seq_id in self._ready

    def _take_commits(self) -> list[DraftCommit]:
        commits = list(self._commits.values())
        self._commits.clear()
        return commits
