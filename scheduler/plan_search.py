"""Pricing a step's shapes and searching the best ones: the adaptive speculation policy's planner (stdlib only).

Chains: the value of a request's j-th candidate is prod_{m<=j} alpha_im (the chance it is reached and
accepted), non-increasing in j. Adding candidates in order of value, across the batch, gives the allocations
worth considering for a number of draft forwards (a request whose draft disagrees loses its deep candidates
first); each prefix of that order, under each depth cap 1 .. K_max (a forward costs something whatever it
carries), is priced with the cost model and the best kept. K = 0 for everyone is the empty prefix: chosen when the
verify curve is steep (compute-bound) or acceptance too low to pay for the draft. The configured tree (when it
is not a chain) is the other menu item, per request: on top of the best chains, each request whose own tree
rounds measure more tokens than its chain takes the tree where that raises the step's rate (and every request at
the tree is priced too); a tree is chosen only where its measured acceptance pays for its extra nodes.

``PlanSearch`` is the policy's base class (scheduler/adaptive.py): its settings are the policy's keyword fields,
and it prices with the policy's curves of this step's regime and its pinned rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.acceptance import expected_tokens

if TYPE_CHECKING:
    from scheduler.acceptance import AcceptanceTracker
    from scheduler.cost_model import CostModel
    from scheduler.spec_policy import SpecPolicy


@dataclass
class _Req:
    """What the plan needs of a request."""

    seq_id: int
    greedy: bool
    cap: int  # deepest round allowed (remaining tokens, contexts)
    inflight: int  # target tokens fed before the tree (1 after a round)
    lag: float  # draft tokens fed before its tree, as the plan prices them (``AdaptivePolicy._amortized_lag``)
    rates: list[float]  # chain per-position acceptance, length cap
    catchup: int = 1  # draft tokens really fed before its next tree (the whole prefix after plain rounds)
    # Price the steady state's extra catch-up token: after a round whose every candidate was accepted the draft
    # also feeds the last candidate (never forwarded), so a request speculating at depth d each round feeds
    # 1 + P(all d accepted) tokens in its first forward, not 1 (see ``_round``). False: ``lag`` is the real
    # catch-up of this step (an exploration's price).
    steady: bool = True


@dataclass
class _Prefix:
    """What every chain allocation of a step starts from: one token per request, the pinned rounds."""

    tokens: float  # expected emitted tokens
    verify: int  # target tokens
    forwards: list[float]  # tokens of each draft forward
    fseqs: list[int]  # sequences of each draft forward
    fixed_s: float  # the controller's seconds
    nseqs: int  # sequences in the step


@dataclass
class _Plan:
    shapes: list[tuple[int, ...]]
    tokens: float  # expected emitted tokens
    seconds: float  # predicted step time

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _add(total: list[float], part: Sequence[float], sign: int = 1) -> None:
    """``total`` += sign * ``part``, position by position (draft forward sizes), growing ``total`` as needed."""
    while len(total) < len(part):
        total.append(0)
    for f, x in enumerate(part):
        total[f] += sign * x


@dataclass(kw_only=True)
class PlanSearch:
    # Speculating must be predicted to beat plain decode by this much (relative). The two errors are not alike:
    # plain decode is the step whose cost the policy knows best at saturation, a speculative step's cost carries
    # the draft's catch-up (priced spread over the request's rounds: ``AdaptivePolicy._amortized_lag``) and the
    # sampled regime's per-node costs, and a plan predicted 3 % better was 25 % slower at batch 32, T = 0.8
    # (larger random pair).
    spec_margin: float = 0.05
    spec_rate: float = 0.0  # the best speculating chains' predicted rate in the last ``best_chains`` (0: none)

    if TYPE_CHECKING:  # the policy's (scheduler/adaptive.py), set by its ``plan``
        base: SpecPolicy
        acceptance: AcceptanceTracker
        _cost: CostModel | None
        _pinned: list[tuple[_Req, tuple[int, ...]]]

        def _regime_cost(self, rs: Sequence[_Req]) -> CostModel: ...

    def _round(self, r: _Req, shape: tuple[int, ...]) -> tuple[float, int, list[float]]:
        """One round's expected emitted tokens, target tokens (the in-flight ones and the tree's nodes) and the
        tokens it adds to each draft forward (forward f carries level f and makes level f + 1)."""
        d = len(shape)
        is_tree = any(w > 1 for w in shape)
        rates = self.acceptance.rates(r.seq_id, r.greedy, d, tuple(shape)) if is_tree else r.rates
        verify = r.inflight
        forwards: list[float] = []
        level = 1  # nodes at level f (level 0: the in-flight tokens)
        # A request that speculates at this shape every round starts each with 1 + P(its whole path accepted)
        # draft tokens: at batch 32 (larger random pair, T = 0.8) chains of 1 fed the draft 55-60 tokens a step,
        # not the 32 they were priced at, and the policy ran them where plain decode was as fast.
        first = r.lag + (math.prod(rates[:d]) if r.steady and d else 0.0)
        for f in range(d):
            forwards.append(first if f == 0 else level)
            level *= shape[f]
            verify += level
        return expected_tokens(rates, d), verify, forwards

    def price(self, rs: Sequence[_Req], shapes: Sequence[tuple[int, ...]]) -> _Plan:
        """Expected tokens and predicted seconds of a step running these shapes (and the pinned rounds')."""
        if self._cost is None:
            self._cost = self._regime_cost(rs)
        tokens = 0.0
        verify = 0
        forwards: list[float] = []
        fseqs: list[int] = []
        pairs = [*zip(rs, shapes, strict=True), *self._pinned]
        for r, shape in pairs:
            t, v, fw = self._round(r, shape)
            tokens += t
            verify += v
            _add(forwards, fw)
            _add(fseqs, [1] * len(fw))
        return _Plan(list(shapes), tokens, self._cost.step_seconds(verify, forwards, len(pairs), fseqs))

    def best_chains(self, rs: Sequence[_Req]) -> _Plan:
        """The best chains: for each depth cap D (1 .. K_max), the best prefix of the candidates no deeper than D
        ordered by value (reached-and-accepted probability); the best of those, or plain decode.

        Why a cap: a draft forward has a fixed cost whatever it carries (built-in draft at batch 16: ~4 ms of a
        7 ms forward), paid once per level any request reaches. Ordered by value alone, a confident request's 7th
        candidate comes before a less confident one's 3rd, so every prefix of the one order ran 7-8 forwards for a
        few requests' tails: at concurrency 16 (greedy, built-in pair) the chosen plans were predicted 4-7 %
        slower than every request at 4, and ran 0.89x a fixed chain of 4. Every uniform depth is the whole
        prefix under its cap, and the allocations between are the prefixes under it."""
        if self._cost is None:
            self._cost = self._regime_cost(rs)
        cands: list[tuple[float, int, int]] = []  # (-value, depth, request index)
        for i, r in enumerate(rs):
            p = 1.0
            for j in range(r.cap):
                p *= r.rates[j]
                cands.append((-p, j, i))
        cands.sort()
        self.spec_rate = 0.0
        pinned = self.price([], [])  # the pinned rounds alone: their tokens and nodes are in every prefix
        base = _Prefix(
            tokens=float(len(rs)) + pinned.tokens,
            verify=sum(r.inflight for r in rs) + self._pinned_verify(),
            forwards=self._pinned_forwards(),
            fseqs=self._pinned_seqs(),
            fixed_s=self._cost.state(len(rs) + len(self._pinned)),
            nseqs=len(rs) + len(self._pinned),  # every plan of this step has them all: one curve of the verify's
        )
        plain_rate = base.tokens / self._prefix_seconds(base)
        best_rate, best_cut = plain_rate, []
        deepest = max((j for _, j, _ in cands), default=-1) + 1
        priced: list[tuple[float, int, int]] | None = None  # a cut whose every prefix was priced (stride 1)
        memo: dict[int | tuple[float, int], float] = {}  # prices of sizes, kept across the caps (``_best_prefix``)
        for cap in range(deepest, 0, -1):
            cut = [c for c in cands if c[1] < cap] if cap < deepest else cands
            if priced is not None and self._is_prefix(cut, priced):
                # Its prefixes were all priced, at the same sums in the same order: it cannot beat the best
                # so far. At batch 1 every cap's cut is a prefix of the deepest one (a chain's values fall with
                # depth), and pricing each again was 36 prices a step instead of 8.
                continue
            priced = cut if len(cut) <= self._PRICES_PER_CAP else None
            n, rate = self._best_prefix(rs, cut, base, memo)
            if n:
                self.spec_rate = max(self.spec_rate, rate)
            if n and rate > best_rate:
                best_rate, best_cut = rate, cut[:n]
        if best_cut and best_rate < plain_rate * (1 + self.spec_margin):
            best_cut = []
        depths = [0] * len(rs)
        for _, j, i in best_cut:
            depths[i] = max(depths[i], j + 1)
        return self.price(rs, [(1,) * d for d in depths])

    _PRICES_PER_CAP = 16  # ``_best_prefix`` prices about this many prefixes of a cut (of a shorter one, all)

    @staticmethod
    def _is_prefix(cut: list[tuple[float, int, int]], of: list[tuple[float, int, int]]) -> bool:
        return len(cut) <= len(of) and of[:len(cut)] == cut

    def _prefix_seconds(self, p: _Prefix) -> float:
        return (self._cost.verify_seconds(p.verify, p.nseqs) + self._cost.draft_seconds(p.forwards, p.fseqs)
                + p.fixed_s)

    def _best_prefix(self, rs: Sequence[_Req], cands: list[tuple[float, int, int]], base: _Prefix,
                     memo: dict[int | tuple[float, int], float]) -> tuple[int, float]:
        """The best non-empty prefix of ``cands`` (sorted by value, each request's in depth order) on top of
        ``base``: its length and rate (0 and 0.0 when there are no candidates). ``memo``: the prices of the sizes
        seen so far in this step's search, kept across its caps (the same sizes recur under every cap, and the
        curves do not move while it runs): verify tokens -> seconds, (draft forward tokens, sequences) -> seconds."""
        tokens, verify = base.tokens, base.verify
        forwards = list(base.forwards)
        fseqs = list(base.fseqs)
        call_cost = self._cost.draft_call

        def draft_cost(n: float, q: int) -> float:
            s = memo.get((n, q))
            if s is None:
                s = memo[n, q] = self._cost.draft_forward(n, q)
            return s

        # The draft's seconds kept per forward and updated where a forward changed (this loop is the policy's
        # per-step cost: re-pricing all K forwards at every prefix was most of it).
        fwd_s = [draft_cost(n, q) for n, q in zip(forwards, fseqs, strict=True)]
        dirty: set[int] = set()

        def draft_s() -> float:
            for f in dirty:
                fwd_s[f] = draft_cost(forwards[f], fseqs[f])
            dirty.clear()
            return sum(fwd_s) + call_cost(forwards[0]) if forwards and forwards[0] > 0 else 0.0

        best_n, best_rate = 0, 0.0
        reached = [0.0] * len(rs)  # value of each request's deepest candidate so far: P(its chain all accepted)
        # Price every prefix in small batches, at most ~16 prices a cap whatever the batch size.
        stride = max(1, -(-len(cands) // self._PRICES_PER_CAP))
        for n, (neg_value, j, i) in enumerate(cands, start=1):
            tokens -= neg_value
            verify += 1
            if len(forwards) <= j:
                forwards.append(0.0)
                fseqs.append(0)
                fwd_s.append(0.0)
            fseqs[j] += 1  # the request's chain now reaches past level j
            r = rs[i]
            if r.steady:  # the first forward's steady catch-up: 1 + P(whole chain accepted), as ``_round``
                forwards[0] += (r.lag if j == 0 else 0.0) - neg_value - reached[i]
                reached[i] = -neg_value
                dirty.add(0)
            elif j == 0:
                forwards[0] += r.lag
            if j > 0:
                forwards[j] += 1
            dirty.add(j)
            if n % stride and n != len(cands):
                continue
            v = memo.get(verify)
            if v is None:
                v = memo[verify] = self._cost.verify_seconds(verify, base.nseqs)
            rate = tokens / (v + draft_s() + base.fixed_s)
            # No early stop when the rate falls: the first candidates pay the draft call's fixed part and a whole
            # forward, so the rate can dip and recover (at batch 32, T = 0.8, a stop at 0.8x the plain rate left
            # the plan to the previous step's chains of 3, which re-priced better than plain decode).
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate

    def _pinned_verify(self) -> int:
        """Target tokens of the step that the plan does not choose: the pinned rounds'."""
        return sum(self._round(r, shape)[1] for r, shape in self._pinned)

    def _pinned_forwards(self) -> list[float]:
        forwards: list[float] = []
        for r, shape in self._pinned:
            _add(forwards, self._round(r, shape)[2])
        return forwards

    def _pinned_seqs(self) -> list[int]:
        """Sequences of each draft forward of the pinned rounds (a round of depth d is in forwards 0 .. d-1)."""
        seqs: list[int] = []
        for _, shape in self._pinned:
            _add(seqs, [1] * len(shape))
        return seqs

    def _trees_where_they_pay(self, rs: Sequence[_Req], chains: _Plan) -> _Plan | None:
        """Per request, the configured tree (cut to its cap) instead of its chain where that raises the step's
        predicted rate: requests in order of the tree's expected extra tokens per extra target token, each switch
        kept when the step's rate rises (None when the tree is a chain or no request gains). Priced by the
        request's own tree rounds (shrunk towards the engine's tree rates, whose prior is the chain's): a tree is
        only chosen for a request whose measured rounds show its siblings accept more than the chain's single
        candidate. Each trial re-prices only the step's totals, so this is linear in the batch."""
        tree = self.base.tree.branching
        if all(w == 1 for w in tree):
            return None
        shapes = list(chains.shapes)
        parts = [self._round(r, s) for r, s in zip(rs, shapes, strict=True)]
        tokens = chains.tokens
        verify = self._pinned_verify() + sum(v for _, v, _ in parts)
        forwards = self._pinned_forwards()
        fseqs = self._pinned_seqs()
        for _, _, fw in parts:
            _add(forwards, fw)
            _add(fseqs, [1] * len(fw))
        nseqs = len(rs) + len(self._pinned)
        seconds = self._cost.step_seconds(verify, forwards, nseqs, fseqs)
        options = []  # (-gain per extra target token, request index, shape, its round)
        for i, r in enumerate(rs):
            t = tree[: r.cap]
            if t == shapes[i] or all(w == 1 for w in t):
                continue
            part = self._round(r, t)
            gain = part[0] - parts[i][0]
            if gain > 0:
                options.append((-gain / max(1, part[1] - parts[i][1]), i, t, part))
        changed = False
        for _, i, t, (t_tok, t_ver, t_fwd) in sorted(options, key=lambda o: (o[0], o[1])):
            c_tok, c_ver, c_fwd = parts[i]
            fw, fq = list(forwards), list(fseqs)
            _add(fw, c_fwd, -1)
            _add(fw, t_fwd)
            _add(fq, [1] * len(c_fwd), -1)
            _add(fq, [1] * len(t_fwd))
            ver = verify - c_ver + t_ver
            tok = tokens - c_tok + t_tok
            sec = self._cost.step_seconds(ver, fw, nseqs, fq)
            if sec > 0 and seconds > 0 and tok / sec > tokens / seconds:
                shapes[i], parts[i] = t, (t_tok, t_ver, t_fwd)
                tokens, verify, forwards, fseqs, seconds, changed = tok, ver, fw, fq, sec, True
        return _Plan(shapes, tokens, seconds) if changed else None

    def _tree_plan(self, rs: Sequence[_Req]) -> _Plan | None:
        """The configured tree (cut to each request's cap) for every request, when it is not a chain."""
        tree = self.base.tree.branching
        if all(w == 1 for w in tree):
            return None
        return self.price(rs, [tree[: r.cap] for r in rs])
