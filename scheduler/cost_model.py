"""The measured cost of a step, for the adaptive speculation policy (stdlib only).

A step costs ``draft + verify + state`` seconds (engine/core/metrics.py ``StepTimes`` splits the wall time the same
way). Each part is a measured curve, not an assumed formula:

- ``verify``: seconds of the target call vs the tokens it forwards (in-flight tokens + tree nodes + prefill);
  flat while the target is memory-bound, rising once the batch fills the compute units. The same tokens cost
  more spread over more sequences (each reads its own context, samples its own rows): a target call of 32 tokens
  took 33.4 ms of CPU as 32 sequences x 1 and 23.8 as 8 x 4 greedy, 34.8 and 28-33 at T = 0.8 (built-in pair,
  ``python -m benchmarks.verify_seqs``). One curve over tokens mixes the two, and the plain plan of a
  batch of 32 was priced from a batch of 8's cheaper 32-token steps. So each
  log2 bucket of the sequence count keeps its own curve (``verify_by_seqs``): a plan, whose sequences are the
  batch's at every depth, is priced on its batch's curve, and past that curve's measured sizes on the shape of
  the all-steps curve, scaled to meet it;
- ``draft``: seconds of one draft forward (with the sampling of the level it feeds) vs the tokens it carries,
  each forward as the draft worker timed it; a round of depth D costs D forwards, the f-th one over the
  requests still deeper than f (a chain of K forwards its in-flight tokens, then levels 1..K-1; the deepest
  level is never forwarded). As for the target, the same tokens cost more over more sequences (each reads its
  own context): at concurrency 64 (larger random pair) a first forward of 107 tokens over 64 sequences took
  0.14-0.21 s and was priced 0.07 s from the start-up's 8 sequences x 13, so the first speculative bet of
  each wave ran on. Each log2 bucket of a forward's sequence count keeps its own curve (``draft_by_seqs``),
  and a count never measured is priced between its measured neighbours (``draft_forward``);
- ``draft_call``: the draft call's fixed part (messaging, the worker's commit and layout, the controller's
  share) vs the requests drafted, paid
  once a step when anyone speculates. Charging it to the forwards instead (the call time / its forwards) makes a
  depth-2 step's forwards look twice as dear as a depth-4 step's, and the policy that runs short chains learns
  that deeper ones are dear too;
- ``state``: the controller's own time per step (schedule, commit, emit) vs the number of requests.

A ``Curve`` keeps an exponentially weighted mean per log2-bucket of its argument and interpolates between
buckets (extrapolating with the slope of the nearest two), so it follows the real shape of the machine and
forgets old measurements (another load, a warmer cache). The engine feeds it every step's measured times.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class _Point:
    x: float  # weighted mean argument in this bucket
    y: float  # weighted mean seconds
    step: int  # when it was last updated
    # Re-measurements after a gap (explorations) in a row that found the bucket where it was: the policy spaces
    # its explorations of a size further apart the more often it found nothing new there.
    confirms: int = 0


@dataclass
class Curve:
    """Seconds vs a size (tokens, requests): EW means per log2 bucket, piecewise-linear in between."""

    decay: float = 0.1  # weight of a new measurement in its bucket (~10 steps: CPU step times are noisy)
    max_jump: float = 0.5  # the most weight one measurement gets in a bucket that has a value
    confirm_tol: float = 0.15  # a re-measurement within this (relative) of the bucket's value confirms it
    points: dict[int, _Point] = field(default_factory=dict)
    clock: int = 0
    _sorted: tuple[list[float], list[float]] | None = field(default=None, repr=False)  # points by x

    @staticmethod
    def bucket(x: float) -> int:
        return 0 if x <= 1 else round(math.log2(x))  # octaves: finer buckets only measure noise more often

    def observe(self, x: float, seconds: float) -> None:
        if x <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self.clock += 1
        self._sorted = None
        b = self.bucket(x)
        p = self.points.get(b)
        if p is None:
            self.points[b] = _Point(float(x), seconds, self.clock)
            return
        if self.clock - p.step > 1:  # measured again after a gap: did it find the value where it was?
            p.confirms = p.confirms + 1 if abs(seconds - p.y) <= self.confirm_tol * p.y else 0
        # Exponential in time (observations of the curve), not in updates of this bucket: a size measured again
        # after a long gap (an exploration step) moves most of the way to the new value instead of nudging it;
        # but never all the way, so one step that another process slowed down 3x does not become the curve.
        a = min(self.max_jump, 1.0 - (1.0 - self.decay) ** (self.clock - p.step))
        p.x += a * (x - p.x)
        p.y += a * (seconds - p.y)
        p.step = self.clock

    def age(self, x: float) -> int | None:
        """Observations since the bucket of ``x`` was last measured; None if never."""
        p = self.points.get(self.bucket(x))
        return None if p is None else self.clock - p.step

    @property
    def ready(self) -> bool:
        return bool(self.points)

    def scaled(self, x: float, shape: Curve, lower: bool = False) -> float:
        """Predicted seconds at ``x``: this curve within its measured sizes; beyond them ``shape`` (a curve with
        more sizes), scaled to meet this one at its nearest measured end, and past its largest size never below
        this curve's own extrapolation (the slope of its last two sizes) where it has two. ``lower``: instead,
        on either side, the lower of the two where it has two (the draft's forwards: ``CostModel._draft_at``).

        Why the floor: the shape's curve mixes other batch sizes and prompt chunks (one sequence's many tokens are
        cheaper per token than many sequences' few). At batch 64 (larger random pair, CPU) the verify of 576
        tokens was priced ~1.5 s from that shape, where this batch size's own 64- and 128-token steps rose
        linearly and the step took ~5 s."""
        xs = [p.x for p in self.points.values()]
        lo, hi = min(xs), max(xs)
        end = lo if x < lo else hi if x > hi else None
        if end is None:
            return self(x)
        ref = shape(end)
        out = self(end) * shape(x) / ref if ref > 0 else self(x)
        if len(xs) < 2:
            return out
        if lower:
            return min(out, self(x))
        return max(out, self(x)) if x > hi else out

    def __call__(self, x: float) -> float:
        """Predicted seconds at ``x`` (0 for x <= 0)."""
        if x <= 0 or not self.points:
            return 0.0
        if self._sorted is None:
            pts = sorted((p.x, p.y) for p in self.points.values())
            self._sorted = ([p[0] for p in pts], monotone([p[1] for p in pts]))
        xs, ys = self._sorted
        if len(xs) == 1:
            return ys[0] * max(1.0, x / xs[0])  # one point: flat below, proportional above
        i = bisect.bisect_left(xs, x)
        if i == 0:  # below the first point: its slope down, but no cheaper than proportional to x
            slope = max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9))
            return max(ys[0] * x / xs[0], ys[0] + slope * (x - xs[0]))
        if i == len(xs):  # past the last point: never cheaper than there
            slope = max(0.0, (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9))
            return ys[-1] + slope * (x - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)


def monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): more tokens never take less time, so a
    noisy bucket that measured cheaper than a smaller one is averaged with it instead of inventing a dip."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


@dataclass
class StepSample:
    """One step as measured by the engine: what it ran and how long each part took (wall seconds)."""

    verify_tokens: int  # tokens the target forwarded (prefill chunks + in-flight + tree nodes)
    verify_s: float
    draft_forward_tokens: list[int]  # tokens of each draft forward of the rounds (empty: nothing drafted)
    draft_s: float  # draft time the controller waited for (pipelining hides the rest)
    draft_prefill: bool  # the draft call also prefilled prompt chunks (its time is not only the forwards)
    num_seqs: int  # requests in the step
    state_s: float  # controller time: schedule + commit/emit
    sampled: bool = False  # some round sampled (temperature > 0): laws travel, residuals are sampled
    # The draft worker's own time of the call (None: not known apart, e.g. pipelined, where it is hidden): the
    # rest of draft_s is the call's fixed part.
    draft_worker_s: float | None = None
    # The worker's seconds of each forward (with the sampling it feeds), when it timed them apart; the rest of
    # draft_s is the call's fixed part.
    draft_forward_s: list[float] | None = None
    # Sequences each draft forward carries (the requests still deeper than its level); None: not known.
    draft_forward_seqs: list[int] | None = None
    prefill_tokens: int = 0  # of verify_tokens, the prompt chunks'


class VerifyRecord(NamedTuple):
    age: int | None  # steps since measured (see ``CostModel.verify_record``)
    measured: bool  # ever measured at this batch size
    confirms: int  # re-measurements in a row that found the price unchanged


@dataclass
class CostModel:
    verify: Curve = field(default_factory=Curve)
    draft: Curve = field(default_factory=Curve)  # one forward
    state: Curve = field(default_factory=Curve)
    draft_call: Curve = field(default_factory=Curve)  # the draft call's fixed part vs requests drafted
    verify_by_seqs: dict[int, Curve] = field(default_factory=dict)  # bucket(sequences) -> verify seconds vs tokens
    draft_by_seqs: dict[int, Curve] = field(default_factory=dict)  # bucket(a forward's sequences) -> its seconds
    # Another regime's model (the sampled regime's: the greedy one), whose batch-size curves stand in where this
    # one's have not measured: see ``verify_seconds``.
    fallback: CostModel | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        """Enough measured to compare plans: the target at two sizes and a draft forward."""
        return len(self.verify.points) >= 2 and self.draft.ready

    def observe(self, s: StepSample) -> None:
        self.verify.observe(s.verify_tokens, s.verify_s)
        # The batch-size curves price decode plans: a step that also prefilled forwarded a prompt's many tokens
        # per sequence, far cheaper per token than as many decode tokens of the batch's sequences. At concurrency 64
        # (larger random pair) the wave steps (56 prompts, 1754 tokens) sat in batch 64's curve above its decode
        # sizes (64-188 tokens), so 576 decode tokens were interpolated cheap: the configured depth for everyone
        # was explored, 5.2 s against 0.5 s for a plain step.
        if s.num_seqs > 0 and not s.prefill_tokens:
            self.verify_by_seqs.setdefault(Curve.bucket(s.num_seqs), Curve()).observe(s.verify_tokens, s.verify_s)
        fwd = [n for n in s.draft_forward_tokens if n > 0]
        if fwd and not s.draft_prefill:
            if s.draft_forward_s is not None and len(s.draft_forward_s) == len(fwd):
                # Each forward at its own size; the call's fixed part (messaging, commit, layout, results) apart.
                # At batch 1 the first forward (the in-flight tokens) took 3.2-3.9 ms and the one-token levels
                # 2.4-2.9 (built-in draft): charged the call's mean at the mean size, a chain of 2's forwards were
                # priced like a chain of 8's, though each cost more.
                seqs = [q for n, q in zip(s.draft_forward_tokens, s.draft_forward_seqs or [], strict=False) if n > 0]
                for f, (n, sec) in enumerate(zip(fwd, s.draft_forward_s, strict=True)):
                    self.draft.observe(n, sec)
                    if len(seqs) == len(fwd) and seqs[f] > 0:
                        self.draft_by_seqs.setdefault(Curve.bucket(seqs[f]), Curve()).observe(n, sec)
                self.draft_call.observe(fwd[0], max(0.0, s.draft_s - sum(s.draft_forward_s)))
            else:  # not timed apart: charge each forward the mean, at its mean size
                worker = s.draft_s if s.draft_worker_s is None else min(s.draft_s, s.draft_worker_s)
                self.draft.observe(sum(fwd) / len(fwd), worker / len(fwd))
                if s.draft_worker_s is not None:
                    self.draft_call.observe(fwd[0], max(0.0, s.draft_s - worker))
        self.state.observe(s.num_seqs, s.state_s)

    def step_seconds(self, verify_tokens: int, draft_forward_tokens: list[float], num_seqs: int,
                     draft_forward_seqs: list[int] | None = None) -> float:
        return (self.verify_seconds(verify_tokens, num_seqs)
                + self.draft_seconds(draft_forward_tokens, draft_forward_seqs) + self.state(num_seqs))

    def verify_seconds(self, verify_tokens: float, num_seqs: int) -> float:
        """The target call forwarding these tokens for this many sequences: the curve of steps with about as many
        sequences where it has measured any (past its sizes, with the shape of the fallback's curve of that batch
        size, or of the all-steps curve); else the fallback's curve of that batch size, times this regime's cost
        over the fallback's at these tokens; else the all-steps curve.

        Sampled steps have their own curves (laws travel, residuals are sampled), but the start-up profiling
        measures them at a few batch sizes only. At batch 32 (larger random pair, T = 0.8) the plain step was
        priced from batch-16 steps of 2 tokens each (cheaper per token than 32 x 1), and the policy ran chains of
        2 at 0.49 s a step where plain decode took 0.2 s; the greedy curve of batch 32 had measured it."""
        if verify_tokens <= 0:
            return self.verify(verify_tokens)
        b = Curve.bucket(num_seqs)
        c = self.verify_by_seqs.get(b)
        g = self.fallback.verify_by_seqs.get(b) if self.fallback is not None else None
        g = g if g is not None and g.points else None
        if c is not None and c.points:
            return c.scaled(verify_tokens, g if g is not None and len(g.points) >= 2 else self.verify)
        if g is not None:
            own, other = self.verify(verify_tokens), self.fallback.verify(verify_tokens)
            # A sampled step never costs less than the greedy one of the same size (the ratio of the all-steps
            # curves mixes batch sizes: it can fall below 1 when the greedy steps ran larger batches).
            return g(verify_tokens) * max(1.0, own / other if own > 0 and other > 0 else 1.0)
        return self.verify(verify_tokens)

    def knows_batch_size(self, num_seqs: int) -> bool:
        """Whether a plan at this batch size is priced from measurements of it: its own curve (or the fallback's)
        has two sizes, or this model keeps no batch-size curves at all (curves made by hand).

        With fewer, every verify size is the all-steps curve's shape scaled to one point: at concurrency 64 on a
        large model whose start-up profiling covered batch 1 only, that shape was batch 1's (memory-bound: flat),
        so 64 requests x 9 tokens looked as cheap as 64 x 1 and the first step ran the configured depth for
        everyone, 7 s against 0.5 s for a plain one."""
        if not self.verify_by_seqs and (self.fallback is None or not self.fallback.verify_by_seqs):
            return True
        b = Curve.bucket(num_seqs)
        return any(m is not None and b in m.verify_by_seqs and len(m.verify_by_seqs[b].points) >= 2
                   for m in (self, self.fallback))

    def _priced_curve(self, num_seqs: int) -> Curve:
        """The curve ``verify_seconds`` starts from: this batch size's where it has measured any, else all steps'."""
        c = self.verify_by_seqs.get(Curve.bucket(num_seqs))
        return self.verify if c is None or not c.points else c

    def verify_record(self, verify_tokens: float, num_seqs: int) -> VerifyRecord:
        """What the curve ``verify_seconds`` prices a target call of about these tokens from knows of that size.

        ``age``: steps of about this many sequences since it was measured; a size never measured there counts
        from the curve's first step (None: nothing measured at all). Counting it as due at once ran a chain-of-4
        step at batch 64 first thing in every run (1.2 s verify and 1.6 s of draft catch-up, against 0.3 s for a
        plain step). ``confirms``: re-measurements in a row that found its price unchanged."""
        c = self._priced_curve(num_seqs)
        p = c.points.get(Curve.bucket(verify_tokens))
        if p is None:
            return VerifyRecord(c.clock if c.points else None, False, 0)
        return VerifyRecord(c.clock - p.step, True, p.confirms)

    def draft_seconds(self, draft_forward_tokens: list[float], draft_forward_seqs: list[int] | None = None
                      ) -> float:
        """The draft call of a step with these forwards (0 without any), each over its sequences where known."""
        seqs = draft_forward_seqs or []
        fwd = [(n, seqs[f] if f < len(seqs) else 0) for f, n in enumerate(draft_forward_tokens) if n > 0]
        if not fwd:
            return 0.0
        return self.draft_call(fwd[0][0]) + sum(self.draft_forward(n, q) for n, q in fwd)

    def draft_forward(self, tokens: float, num_seqs: int) -> float:
        """One draft forward of these tokens over this many sequences (0 for none): the curve of forwards over
        about as many sequences where it has measured any; between two measured sequence counts, linear in the
        sequences; past the largest, the line of the largest two (never below the largest); with nothing
        measured by sequences (or ``num_seqs`` unknown: 0), the all-forwards curve.

        Why between: a plan's forwards carry any number of its requests (the chains of 40 of 64, say), and a
        count whose bucket was never measured priced on the all-forwards curve looked as cheap as the start-up's
        8-sequence forwards again."""
        if tokens <= 0:
            return 0.0
        if num_seqs <= 0 or not self.draft_by_seqs:
            return self.draft(tokens)
        b = Curve.bucket(num_seqs)
        own = self.draft_by_seqs.get(b)
        if own is not None and own.points:
            return self._draft_at(own, tokens)
        known = sorted(k for k, c in self.draft_by_seqs.items() if c.points)
        below = [k for k in known if k < b]
        above = [k for k in known if k > b]

        def at(k: int) -> float:
            return self._draft_at(self.draft_by_seqs[k], tokens)

        if not below:  # fewer sequences than any measured: the smallest count's price (fewer never cost more)
            return at(above[0]) if above else self.draft(tokens)
        if not above and len(below) == 1:
            return at(below[-1])
        a, z = (below[-1], above[0]) if above else (below[-2], below[-1])
        y0, y1 = at(a), at(z)
        out = y0 + (y1 - y0) * (num_seqs - 2 ** a) / (2 ** z - 2 ** a)
        return out if above else max(out, y1)

    def _draft_at(self, c: Curve, tokens: float) -> float:
        """A sequence count's forward curve at ``tokens``: within its measured sizes, its own line; past them, the
        lower of its own line's extrapolation and the all-forwards curve's shape scaled to meet it at its nearest
        end (with one size, that shape alone).

        Why the lower: either extrapolation can be far off. The all-forwards curve's larger sizes are mostly larger
        batches' (their first forward carries a few tokens per sequence): it rose 7x between 16 and 64 tokens
        where 8 sequences' own forwards rose by a few percent. And a curve measured at 1 and 2 tokens (batch 1's
        one-token levels and steady first forwards: 4.9 and 6.1 ms, built-in draft) extrapolated to a catch-up of
        40 tokens over one sequence at 51 ms, where such a forward takes ~10: a single request then decoded plainly
        for its whole life (the catch-up grows while it does)."""
        return c.scaled(tokens, self.draft, lower=True)


def curve_to_dict(c: Curve) -> dict:
    """A curve's measured points (JSON-safe); ``curve_from_dict`` reads them back with fresh step counts."""
    return {"points": [[b, p.x, p.y, p.confirms] for b, p in sorted(c.points.items())]}


def curve_from_dict(d: dict) -> Curve:
    """The inverse of ``curve_to_dict``; ValueError on anything that is not a list of finite, non-negative
    points (the file it came from is an input like any other)."""
    c = Curve()
    for row in d["points"]:
        b, x, y, confirms = row
        if not (isinstance(b, int) and isinstance(confirms, int) and all(isinstance(v, (int, float)) for v in (x, y))
                and math.isfinite(x) and math.isfinite(y) and x > 0 and y >= 0 and b == Curve.bucket(x)):
            raise ValueError(f"not a cost-curve point: {row!r}")
        c.points[b] = _Point(float(x), float(y), 0, max(0, confirms))
    return c


def cost_model_to_dict(m: CostModel) -> dict:
    return {"verify": curve_to_dict(m.verify), "draft": curve_to_dict(m.draft), "state": curve_to_dict(m.state),
            "draft_call": curve_to_dict(m.draft_call),
            "verify_by_seqs": {str(b): curve_to_dict(c) for b, c in sorted(m.verify_by_seqs.items())},
            "draft_by_seqs": {str(b): curve_to_dict(c) for b, c in sorted(m.draft_by_seqs.items())}}


def cost_model_from_dict(d: dict) -> CostModel:
    return CostModel(verify=curve_from_dict(d["verify"]), draft=curve_from_dict(d["draft"]),
                     state=curve_from_dict(d["state"]), draft_call=curve_from_dict(d["draft_call"]),
                     verify_by_seqs={int(b): curve_from_dict(c) for b, c in d["verify_by_seqs"].items()},
                     draft_by_seqs={int(b): curve_from_dict(c) for b, c in d["draft_by_seqs"].items()})
