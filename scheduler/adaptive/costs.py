"""The measured cost of a step (stdlib only): ``verify + draft + state`` seconds, each a measured curve
(docs/adaptive.md, Costs)."""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from scheduler.adaptive.config import AdaptiveConfig

_DEFAULTS = AdaptiveConfig()


def bucket(x: float) -> int:
    """The one size bucketing of the subsystem (batch sizes, tokens): octaves, 1 -> 0, 2 -> 1, 3-5 -> 2, ..."""
    return 0 if x <= 1 else round(math.log2(x))


@dataclass
class StepLoad:
    """What one step carries: the target's tokens and each draft forward's tokens and sequences. The one place
    a round's shape becomes tokens: forward f carries level f and makes level f + 1; the first forward carries
    the tokens the draft has not seen yet."""

    verify_tokens: float = 0.0
    forward_tokens: list[float] = field(default_factory=list)
    forward_seqs: list[int] = field(default_factory=list)
    num_seqs: int = 0
    prefill_tokens: int = 0
    sampled: bool = False

    def add(self, inflight: float, first_forward: float, shape: Sequence[int], forwards: bool = True) -> None:
        """A round: ``inflight`` target tokens before its tree, ``first_forward`` draft tokens in its first forward
        (``forwards`` false: its candidates come from a proposer in the controller, no draft forward)."""
        self.num_seqs += 1
        self.verify_tokens += inflight
        level = 1
        for f, w in enumerate(shape):
            if forwards:
                self.feed(f, first_forward if f == 0 else level)
            level *= w
            self.verify_tokens += level

    def feed(self, f: int, tokens: float, seqs: int = 1) -> None:
        """``tokens`` more for draft forward ``f``, carried by ``seqs`` more sequences."""
        while len(self.forward_tokens) <= f:
            self.forward_tokens.append(0.0)
            self.forward_seqs.append(0)
        self.forward_tokens[f] += tokens
        self.forward_seqs[f] += seqs


@dataclass
class StepTiming:
    """How long a step's parts took (wall seconds, as the controller saw them)."""

    verify_s: float
    draft_s: float  # draft time the controller waited for (pipelining hides the rest)
    state_s: float  # schedule + commit/emit
    draft_prefill: bool = False  # the draft call also prefilled prompt chunks
    draft_forward_s: list[float] | None = None  # the worker's seconds of each forward (None: pipelined, hidden)


@dataclass
class _Point:
    x: float
    y: float
    step: int  # when last updated


@dataclass
class Curve:
    """Seconds vs a size: EW means per log2 bucket, monotone, piecewise-linear in between."""

    decay: float = _DEFAULTS.curve_decay
    max_jump: float = _DEFAULTS.curve_max_jump
    points: dict[int, _Point] = field(default_factory=dict)
    clock: int = 0
    _sorted: tuple[list[float], list[float]] | None = field(default=None, repr=False)

    def observe(self, x: float, seconds: float) -> None:
        if x <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        self.clock += 1
        self._sorted = None
        p = self.points.get(bucket(x))
        if p is None:
            self.points[bucket(x)] = _Point(float(x), seconds, self.clock)
            return
        # Exponential in the curve's time, not in this bucket's updates: a size re-measured after a long gap moves
        # most of the way, never all of it (one slowed-down step must not become the curve).
        a = min(self.max_jump, 1.0 - (1.0 - self.decay) ** (self.clock - p.step))
        p.x += a * (x - p.x)
        p.y += a * (seconds - p.y)
        p.step = self.clock

    @property
    def ready(self) -> bool:
        return bool(self.points)

    def scaled(self, x: float, shape: Curve, lower: bool = False) -> float:
        """This curve within its measured sizes; beyond them ``shape`` scaled to meet it at its nearest end, past
        its largest size never below its own extrapolation (``lower``: the lower of the two on either side)."""
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
        if x <= 0 or not self.points:
            return 0.0
        if self._sorted is None:
            pts = sorted((p.x, p.y) for p in self.points.values())
            self._sorted = ([p[0] for p in pts], _monotone([p[1] for p in pts]))
        xs, ys = self._sorted
        if len(xs) == 1:
            return ys[0] * max(1.0, x / xs[0])  # flat below, proportional above
        i = bisect.bisect_left(xs, x)
        if i == 0:  # its slope down, but no cheaper than proportional to x
            slope = max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9))
            return max(ys[0] * x / xs[0], ys[0] + slope * (x - xs[0]))
        if i == len(xs):
            slope = max(0.0, (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9))
            return ys[-1] + slope * (x - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)


def _monotone(ys: list[float]) -> list[float]:
    """Pool adjacent violators: more tokens never take less time, so a noisy dip is averaged away."""
    blocks: list[list[float]] = []
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


@dataclass
class CostModel:
    config: AdaptiveConfig = _DEFAULTS  # its curves' memory: curve_decay, curve_max_jump
    verify: Curve = field(default_factory=Curve)
    draft: Curve = field(default_factory=Curve)
    state: Curve = field(default_factory=Curve)
    draft_call: Curve = field(default_factory=Curve)
    verify_by_seqs: dict[int, Curve] = field(default_factory=dict)
    draft_by_seqs: dict[int, Curve] = field(default_factory=dict)
    # prices already computed while one plan is made (``planning``): a plan prices ~100 loads that share most of
    # their forwards, and the curves do not change until the step is observed
    _memo: dict | None = field(default=None, init=False, repr=False, compare=False)

    @contextlib.contextmanager
    def planning(self) -> Iterator[CostModel]:
        """Within it, verify and draft-forward prices are computed once per argument (the planner's ~1.9 ms a step
        at 8 requests was mostly re-pricing the same forwards)."""
        outer = self._memo
        self._memo = {} if outer is None else outer
        try:
            yield self
        finally:
            self._memo = outer

    def _priced(self, price: Callable[[float, int], float], tokens: float, num_seqs: int) -> float:
        """``price(tokens, num_seqs)``, computed once per argument while a plan is made."""
        if self._memo is None:
            return price(tokens, num_seqs)
        key = (price.__name__, tokens, num_seqs)
        if key not in self._memo:
            self._memo[key] = price(tokens, num_seqs)
        return self._memo[key]

    def __post_init__(self) -> None:
        for c in [getattr(self, n) for n in _CURVES] + [c for n in _BY_SEQS for c in getattr(self, n).values()]:
            c.decay, c.max_jump = self.config.curve_decay, self.config.curve_max_jump

    def _curve(self) -> Curve:
        return Curve(self.config.curve_decay, self.config.curve_max_jump)

    @property
    def ready(self) -> bool:
        """Enough measured to compare plans: the target at two sizes and a draft forward."""
        return len(self.verify.points) >= 2 and self.draft.ready

    def observe(self, load: StepLoad, t: StepTiming) -> None:
        self.verify.observe(load.verify_tokens, t.verify_s)
        # Prompt chunks are many tokens per sequence, far cheaper per token: not the batch size's decode curve.
        if load.num_seqs > 0 and not load.prefill_tokens:
            self.verify_by_seqs.setdefault(bucket(load.num_seqs), self._curve()).observe(load.verify_tokens, t.verify_s)
        fwd = [(n, q) for n, q in zip(load.forward_tokens, load.forward_seqs, strict=True) if n > 0]
        if fwd and not t.draft_prefill:
            if t.draft_forward_s is not None and len(t.draft_forward_s) == len(fwd):
                for (n, q), sec in zip(fwd, t.draft_forward_s, strict=True):
                    self.draft.observe(n, sec)
                    self.draft_by_seqs.setdefault(bucket(q), self._curve()).observe(n, sec)
                self.draft_call.observe(fwd[0][0], max(0.0, t.draft_s - sum(t.draft_forward_s)))
            elif t.draft_forward_s is None:  # pipelined: each forward the mean of the wait, at its mean size
                self.draft.observe(sum(n for n, _ in fwd) / len(fwd), t.draft_s / len(fwd))
        self.state.observe(load.num_seqs, t.state_s)

    def step_seconds(self, load: StepLoad) -> float:
        return (self.verify_seconds(load.verify_tokens, load.num_seqs)
                + self.draft_seconds(load.forward_tokens, load.forward_seqs) + self.state(load.num_seqs))

    def verify_seconds(self, tokens: float, num_seqs: int) -> float:
        """This batch size's curve where it measured any (past its sizes, on the all-steps shape), else all steps'."""
        return self._priced(self._verify_seconds, tokens, num_seqs)

    def _verify_seconds(self, tokens: float, num_seqs: int) -> float:
        c = self.verify_by_seqs.get(bucket(num_seqs))
        return c.scaled(tokens, self.verify) if tokens > 0 and c is not None and c.points else self.verify(tokens)

    def knows_batch_size(self, num_seqs: int) -> bool:
        """This batch size measured at two sizes, or no batch-size curves kept at all (curves made by hand)."""
        c = self.verify_by_seqs.get(bucket(num_seqs))
        return not self.verify_by_seqs or (c is not None and len(c.points) >= 2)

    def size_record(self, tokens: float, num_seqs: int) -> tuple[int | None, bool]:
        """(age, measured) of this size on the curve pricing it: age in that curve's steps (never measured: since
        its first step; None: the curve has measured nothing)."""
        c = self.verify_by_seqs.get(bucket(num_seqs))
        c = self.verify if c is None or not c.points else c
        p = c.points.get(bucket(tokens))
        if p is None:
            return (c.clock if c.points else None), False
        return c.clock - p.step, True

    def draft_seconds(self, tokens: Sequence[float], seqs: Sequence[int]) -> float:
        fwd = [(n, seqs[f] if f < len(seqs) else 0) for f, n in enumerate(tokens) if n > 0]
        if not fwd:
            return 0.0
        return self.draft_call(fwd[0][0]) + sum(self.draft_forward(n, q) for n, q in fwd)

    def draft_forward(self, tokens: float, num_seqs: int) -> float:
        """The curve of forwards over about as many sequences (else the nearest count measured), extrapolated on
        the all-forwards shape, the lower of the two (either alone kept requests from ever speculating)."""
        if tokens <= 0:
            return 0.0
        return self._priced(self._draft_forward, tokens, num_seqs)

    def _draft_forward(self, tokens: float, num_seqs: int) -> float:
        known = [k for k, c in self.draft_by_seqs.items() if c.points]
        if num_seqs <= 0 or not known:
            return self.draft(tokens)
        b = min(known, key=lambda k: (abs(k - bucket(num_seqs)), -k))
        return self.draft_by_seqs[b].scaled(tokens, self.draft, lower=True)

    def to_dict(self) -> dict:
        return {**{n: _curve_to_dict(getattr(self, n)) for n in _CURVES},
                **{n: {str(b): _curve_to_dict(c) for b, c in sorted(getattr(self, n).items())} for n in _BY_SEQS}}

    @classmethod
    def from_dict(cls, d: dict, config: AdaptiveConfig = _DEFAULTS) -> CostModel:
        """The inverse of ``to_dict``; ValueError on anything but finite, non-negative points (a file is input)."""
        return cls(config, **{n: _curve_from_dict(d[n]) for n in _CURVES},
                   **{n: {int(b): _curve_from_dict(c) for b, c in d[n].items()} for n in _BY_SEQS})


_CURVES, _BY_SEQS = ("verify", "draft", "state", "draft_call"), ("verify_by_seqs", "draft_by_seqs")


def _curve_to_dict(c: Curve) -> dict:
    return {"points": [[b, p.x, p.y] for b, p in sorted(c.points.items())]}


def _curve_from_dict(d: dict) -> Curve:
    c = Curve()
    for row in d["points"]:
        b, x, y = row
        if not (isinstance(b, int) and all(isinstance(v, int | float) for v in (x, y))
                and math.isfinite(x) and math.isfinite(y) and x > 0 and y >= 0 and b == bucket(x)):
            raise ValueError(f"not a cost-curve point: {row!r}")
        c.points[b] = _Point(float(x), float(y), 0)
    return c
