# At each node, children x_i in drawn order (q_i = the law x_i was drawn from): r := p, then for each child
# accept x_i with prob min(1, r(x_i) / q_i(x_i)), else r := norm(max(0, r - q_i)) and try the next one.
# No child accepted: emit a draw from r (recovered). A leaf reached: emit a draw from p (bonus).
"""Lossless verification of a draft's candidate tree against the target's distributions (docs/architecture.md).

A chain is the one-child case (Leviathan et al. 2.3 / A.1); siblings tried against the running residual are
SpecInfer's multi-step speculative sampling (i.i.d. children) or recursive rejection sampling (children drawn
without replacement, each with its own renormalised law).

Vocabulary as in vLLM's rejection sampler: *accepted* draft tokens, then one *recovered* token (drawn from the
residual after a rejection) or one *bonus* token (drawn from p after the last accepted leaf).

Randomness: a tree of N nodes consumes exactly N + 1 uniforms per round, u[i] for the accept test of node i
(used only if node i is tried) and u[N] for the final draw. Fixing the count keeps a seeded request's stream
independent of how the round went, and lets tests replay fixed draws (`uniforms=`).

The work is vectorised over a batch of trees of one shape: the residual a node is tried against depends only
on its parent's p and its earlier siblings' q (if an earlier sibling had been accepted the node would not be
tried at all), so every node's residual and accept bit are computed up front in a few batched passes, then the
walk from the root reads the [B, N] accept bits on the host (one small read: the walk is a handful of integer
steps per tree, where a tensor walk costed ~20 tiny kernels per depth), and one batched draw makes the final tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.messages import VerifyResult
from workers.sampling import draw_uniforms, sample_with_uniforms

__all__ = ["BatchVerifyOutput", "CandidateTree", "VerifyResult", "pad_draft_probs", "residual_distribution",
           "truncate_at_stop", "verify_batch", "verify_greedy", "verify_tree", "verify_tree_batch"]

# Trees of one shape are verified together; chunk so the two [B, N, V] float32 work tensors stay ~256 MiB each.
_MAX_WORK_ELEMENTS = 1 << 26


@dataclass
class CandidateTree:
    """One request's candidates for one round (see module doc). A chain has parents = [-1, 0, 1, ...]."""

    tokens: torch.Tensor  # [N] long node token ids
    parents: torch.Tensor  # [N] long, -1 = child of the root, parents[i] < i; siblings in drawn (= tried) order
    draft_probs: torch.Tensor  # [N, V] float32, q_i: the law node i was actually drawn from (docs/architecture.md)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} differ")
        if self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n:
            raise ValueError(f"draft_probs has shape {tuple(self.draft_probs.shape)}, expected [{n}, vocab]")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor) -> CandidateTree:
        n = tokens.shape[0]
        parents = torch.arange(n, dtype=torch.long, device=tokens.device) - 1
        return CandidateTree(tokens.long(), parents, draft_probs)

    @staticmethod
    def empty(vocab_size: int, device: torch.device | str | None = None) -> CandidateTree:
        """No speculation this round: verification emits one token drawn from p (reported as a bonus)."""
        return CandidateTree(
            torch.empty(0, dtype=torch.long, device=device),
            torch.empty(0, dtype=torch.long, device=device),
            torch.empty(0, vocab_size, dtype=torch.float32, device=device),
        )


@dataclass
class BatchVerifyOutput:
    """Verification of B same-shaped trees: B ``VerifyResult``s as tensors on the verification device (the
    statistical tests read them so; ``to_results`` gives the one result type)."""

    path: torch.Tensor  # [B, D] long accepted node indices root to leaf, -1 padded (D = tree depth)
    path_tokens: torch.Tensor  # [B, D] long the accepted tokens, -1 padded
    num_accepted: torch.Tensor  # [B] long
    final_token: torch.Tensor  # [B] long recovered or bonus token
    bonus: torch.Tensor  # [B] bool

    def to_results(self) -> list[VerifyResult]:
        path, toks = self.path.tolist(), self.path_tokens.tolist()
        n_acc, final, bonus = self.num_accepted.tolist(), self.final_token.tolist(), self.bonus.tolist()
        return [
            VerifyResult(path[b][: n_acc[b]], toks[b][: n_acc[b]] + [final[b]], n_acc[b], bool(bonus[b]))
            for b in range(len(n_acc))
        ]


@dataclass(frozen=True)
class _Shape:
    """Index tables for one tree topology. Slot s = node s - 1; slot 0 is the root."""

    num_nodes: int
    depth: int  # longest root-to-leaf path in nodes
    parent_slot: tuple[int, ...]  # [N] the target_probs row governing node i's sibling group
    nodes_by_rank: tuple[tuple[int, ...], ...]  # nodes grouped by position among their siblings
    prev_in_rank: tuple[tuple[int, ...], ...]  # per rank > 0: each node's previous sibling, as a position in
    #                                            the previous rank's group
    rank_order_inverse: tuple[int, ...]  # [N] node i's position in the concatenated rank groups
    rank_pos: tuple[tuple[int, int], ...]  # [N] node i's (rank, position in that rank's group)
    child_table: tuple[tuple[int, ...], ...]  # [N + 1, max_children] node ids per slot, -1 padded
    last_child: tuple[int, ...]  # [N + 1] last child of each slot, -1 for a leaf


@functools.lru_cache(maxsize=1024)
def _tree_shape(parents: tuple[int, ...]) -> _Shape:
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    prev_sibling, ranks, depth = [], [], [0] * (n + 1)
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"parents must be topological (-1 <= parents[i] < i); node {i} has parent {par}")
        sibs = children[par + 1]
        prev_sibling.append(sibs[-1] if sibs else -1)
        ranks.append(len(sibs))
        sibs.append(i)
        depth[i + 1] = depth[par + 1] + 1
    width = max((len(c) for c in children), default=0)
    by_rank = [[i for i in range(n) if ranks[i] == r] for r in range(width)]
    position = {i: pos for group in by_rank for pos, i in enumerate(group)}
    order = [i for group in by_rank for i in group]
    inverse = [0] * n
    for pos, i in enumerate(order):
        inverse[i] = pos
    return _Shape(
        num_nodes=n,
        depth=max(depth),
        parent_slot=tuple(p + 1 for p in parents),
        nodes_by_rank=tuple(tuple(g) for g in by_rank),
        prev_in_rank=tuple(tuple(position[prev_sibling[i]] for i in g) for g in by_rank[1:]),
        rank_order_inverse=tuple(inverse),
        rank_pos=tuple((ranks[i], position[i]) for i in range(n)),
        child_table=tuple(tuple(c + [-1] * (width - len(c))) for c in children),
        last_child=tuple(c[-1] if c else -1 for c in children),
    )


def residual_distribution(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)) along the last dim: the law to fall back on once a draw from q was rejected.

    The mass is 0 only when r <= q everywhere, i.e. r == q up to rounding; then acceptance was certain in
    exact arithmetic and a rejection is a rounding artefact, so r itself is returned (never a 0/0 NaN).
    """
    diff = (r - q).clamp_(min=0)  # [..., V]; in place on the fresh difference: same bits, no extra buffers
    mass = diff.sum(dim=-1, keepdim=True)  # [..., 1]
    diff.div_(mass.clamp(min=torch.finfo(diff.dtype).tiny))
    positive = mass > 0
    return diff if bool(positive.all()) else torch.where(positive, diff, r)


def verify_tree_batch(
    parents: Sequence[int],
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> BatchVerifyOutput:
    """Verify B trees sharing one topology `parents` (length N).

    tokens [B, N] long (-1 = node absent in that tree: never tried, nor are its descendants; this is how a
    draft that returned fewer children is padded), draft_probs [B, N, V], target_probs [B, N + 1, V],
    uniforms [B, N + 1] in [0, 1). Raises ValueError if a present node has q_i(x_i) == 0.
    """
    shape = _tree_shape(tuple(int(p) for p in parents))
    n = shape.num_nodes
    bsz, vocab = target_probs.shape[0], target_probs.shape[-1]
    if tokens.shape != (bsz, n) or draft_probs.shape != (bsz, n, vocab):
        raise ValueError(
            f"expected tokens [{bsz}, {n}] and draft_probs [{bsz}, {n}, {vocab}], got "
            f"{tuple(tokens.shape)} and {tuple(draft_probs.shape)}"
        )
    if target_probs.shape != (bsz, n + 1, vocab) or uniforms.shape != (bsz, n + 1):
        raise ValueError(
            f"expected target_probs [{bsz}, {n + 1}, {vocab}] and uniforms [{bsz}, {n + 1}], got "
            f"{tuple(target_probs.shape)} and {tuple(uniforms.shape)}"
        )
    dev = target_probs.device
    target_probs = target_probs.float()
    draft_probs = draft_probs.float().to(dev)
    tokens, uniforms = tokens.to(dev), uniforms.to(dev)

    def ids(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=dev)

    # (index_select / gather rather than advanced indexing: the latter is several times slower on CPU.)
    # Which nodes each tree has (an absent node hides its subtree), worked out on the host, where the walk runs.
    tok_rows: list[list[int]] = tokens.tolist()  # [B][N]
    present_rows: list[list[bool]] = []
    for row in tok_rows:
        pres: list[bool] = []
        for i, t in enumerate(row):
            par = shape.parent_slot[i] - 1
            pres.append(t >= 0 and (par < 0 or pres[par]))
        present_rows.append(pres)
    present = torch.tensor(present_rows, dtype=torch.bool, device=dev).view(bsz, n)  # [B, N]
    tok = tokens.clamp(min=0).unsqueeze(-1)  # [B, N, 1]
    q_x = draft_probs.gather(2, tok).squeeze(-1)  # [B, N]
    if bool((present & ~(q_x > 0)).any()):
        bad = (present & ~(q_x > 0)).nonzero()[0].tolist()
        raise ValueError(
            f"candidate node {bad[1]} (tree {bad[0]}) has draft probability 0 for its own token: "
            "draft_probs must be the law the token was drawn from"
        )
    if n == 0:  # no speculation: a bonus draw from p
        path = torch.empty(bsz, 0, dtype=torch.long, device=dev)
        final = sample_with_uniforms(target_probs[:, 0], uniforms[:, 0])
        ones = torch.ones(bsz, dtype=torch.bool, device=dev)
        return BatchVerifyOutput(path, path.clone(), torch.zeros(bsz, dtype=torch.long, device=dev), final, ones)

    # Per sibling rank: r, the residual a node is tried against, and `after`, the residual once it is
    # rejected (an absent node leaves it unchanged). Rank j's r is rank j-1's `after`.
    # A chain's nodes all have rank 0 with parent slots 0..N-1, so its rows are slices, not copies.
    all_present = all(all(row) for row in present_rows)
    r_x_parts, after_parts = [], []
    for rank, nodes in enumerate(shape.nodes_by_rank):
        idx = ids(nodes)
        whole = len(nodes) == n  # then nodes == 0..N-1 in order
        if rank == 0:
            slots = [shape.parent_slot[i] for i in nodes]
            r = (target_probs.narrow(1, slots[0], n) if whole and slots == list(range(slots[0], slots[0] + n))
                 else target_probs.index_select(1, ids(slots)))  # [B, n_rank, V]
        else:
            r = after_parts[-1].index_select(1, ids(shape.prev_in_rank[rank - 1]))
        res = residual_distribution(r, draft_probs if whole else draft_probs.index_select(1, idx))
        after_parts.append(res if all_present else torch.where(present.index_select(1, idx).unsqueeze(-1), res, r))
        r_x_parts.append(r.gather(2, tok if whole else tok.index_select(1, idx)).squeeze(-1))  # [B, n_rank]
    r_x = torch.cat(r_x_parts, dim=1).index_select(1, ids(shape.rank_order_inverse))  # [B, N]
    # u < r(x)/q(x) without dividing: q(x) > 0 is checked above, and r(x) >= q(x) accepts surely (u < 1).
    accept_rows: list[list[bool]] = (present & (uniforms[:, :n] * q_x < r_x)).tolist()  # [B][N]

    paths: list[list[int]] = []
    bonus: list[bool] = []
    finals: list[torch.Tensor] = []  # [V] per tree: the law the final token is drawn from
    for b in range(bsz):
        acc, slot, walk = accept_rows[b], 0, []
        while True:
            kids = [c for c in shape.child_table[slot] if c >= 0 and present_rows[b][c]]
            chosen = next((c for c in kids if acc[c]), None)  # the first accepted child, in tried order
            if chosen is None:
                if kids:  # every child rejected: recovered, from the residual after the last one
                    rank, pos = shape.rank_pos[shape.last_child[slot]]
                    finals.append(after_parts[rank][b, pos])
                else:  # a leaf of this tree: bonus, from p after it
                    finals.append(target_probs[b, slot])
                bonus.append(not kids)
                break
            walk.append(chosen)
            slot = chosen + 1
        paths.append(walk)

    final_probs = torch.stack(finals) if finals else target_probs.new_zeros(0, vocab)  # [B, V]
    final_token = sample_with_uniforms(final_probs, uniforms[:, n])
    pad = [[-1] * (shape.depth - len(w)) for w in paths]
    path = torch.tensor([w + p for w, p in zip(paths, pad, strict=True)], dtype=torch.long, device=dev)
    path_tokens = torch.tensor([[toks[c] for c in w] + p for toks, w, p in zip(tok_rows, paths, pad, strict=True)],
                               dtype=torch.long, device=dev)
    num_accepted = torch.tensor([len(w) for w in paths], dtype=torch.long, device=dev)
    bonus_t = torch.tensor(bonus, dtype=torch.bool, device=dev)
    return BatchVerifyOutput(path.view(bsz, shape.depth), path_tokens.view(bsz, shape.depth), num_accepted,
                             final_token, bonus_t)


def _check_vocab(tree: CandidateTree, target_probs: torch.Tensor) -> None:
    n, vd, vt = tree.num_nodes, tree.draft_probs.shape[1], target_probs.shape[-1]
    if target_probs.shape != (n + 1, vt):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{n + 1}, vocab]")
    if vd != vt:
        raise ValueError(
            f"draft vocab {vd} != target vocab {vt}: pad the draft's q with pad_draft_probs "
            "(token ids must mean the same thing on both sides)"
        )


def verify_tree(
    tree: CandidateTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    *,
    uniforms: Sequence[float] | torch.Tensor | None = None,
) -> VerifyResult:
    """Verify one tree. target_probs [N + 1, V]: row 0 for the root's children, row i + 1 after node i.

    uniforms (tests only): N + 1 values in [0, 1) replacing the generator's draws, see the module doc.
    """
    return verify_batch([tree], [target_probs], [generator], uniforms=None if uniforms is None else [uniforms])[0]


def verify_batch(
    trees: Sequence[CandidateTree],
    target_probs: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator | None],
    *,
    uniforms: Sequence[Sequence[float] | torch.Tensor] | None = None,
) -> list[VerifyResult]:
    """Verify one tree per request; trees of the same shape and vocab are verified in one vectorised call.

    Each request draws its N_i + 1 uniforms from its own generator, in request order, before any work.
    """
    if not len(trees) == len(target_probs) == len(generators):
        raise ValueError(f"got {len(trees)} trees, {len(target_probs)} target_probs, {len(generators)} generators")
    for tree, p in zip(trees, target_probs, strict=True):
        _check_vocab(tree, p)
    if uniforms is None:
        dev = target_probs[0].device if trees else "cpu"
        us = draw_uniforms(generators, [t.num_nodes + 1 for t in trees], dev)
    else:
        us = [torch.as_tensor(u, dtype=torch.float32) for u in uniforms]

    groups: dict[tuple, list[int]] = {}
    for i, tree in enumerate(trees):
        groups.setdefault((tuple(tree.parents.tolist()), target_probs[i].shape[-1]), []).append(i)
    results: list[VerifyResult | None] = [None] * len(trees)
    for (parents, vocab), members in groups.items():
        step = max(1, _MAX_WORK_ELEMENTS // max(1, len(parents) * vocab))
        for start in range(0, len(members), step):
            chunk = members[start : start + step]
            dev = target_probs[chunk[0]].device
            out = verify_tree_batch(
                parents,
                torch.stack([trees[i].tokens.to(dev) for i in chunk]),
                torch.stack([trees[i].draft_probs.to(dev) for i in chunk]),
                torch.stack([target_probs[i] for i in chunk]),
                torch.stack([us[i].to(dev) for i in chunk]),
            )
            for i, res in zip(chunk, out.to_results(), strict=True):
                results[i] = res
    return results  # type: ignore[return-value]


def verify_greedy(tree: CandidateTree, target_argmax: torch.Tensor) -> VerifyResult:
    """Temperature 0: descend into the first child equal to the target's argmax; emit the argmax otherwise.

    target_argmax [N + 1] long, laid out like target_probs rows. Equals verify_tree with one-hot p.
    """
    if target_argmax.shape != (tree.num_nodes + 1,):
        raise ValueError(f"target_argmax has shape {tuple(target_argmax.shape)}, expected [{tree.num_nodes + 1}]")
    shape = _tree_shape(tuple(tree.parents.tolist()))
    toks, best = tree.tokens.tolist(), target_argmax.tolist()
    slot, path = 0, []
    while True:
        kids = [c for c in shape.child_table[slot] if c >= 0]
        match = next((c for c in kids if toks[c] == best[slot]), None)
        if match is None:
            return VerifyResult(path, [toks[c] for c in path] + [best[slot]], len(path), bonus=not kids)
        path.append(match)
        slot = match + 1


def truncate_at_stop(tokens: list[int], stop_token_ids: set[int], max_new: int) -> tuple[list[int], bool]:
    """Cut emitted tokens after the first stop token (kept) or at max_new tokens, whichever comes first.

    Returns (kept, stopped_by_token). A stop token among the accepted ones ends the round there: what the
    target would have emitted after it is not part of the output.
    """
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    kept = tokens[:max_new]
    for i, t in enumerate(kept):
        if t in stop_token_ids:
            return kept[: i + 1], True
    return kept, False


def pad_draft_probs(q: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[..., Vd] -> [..., Vt] with zeros appended: ids past the draft's vocab are tokens it never proposes.

    Assumes the draft's ids are a prefix of the target's (same tokenizer, target padded for extra tokens).
    """
    vd = q.shape[-1]
    if vd > target_vocab:
        raise ValueError(f"draft vocab {vd} is larger than target vocab {target_vocab}: cannot pad q down")
    if vd == target_vocab:
        return q
    return torch.nn.functional.pad(q, (0, target_vocab - vd))
