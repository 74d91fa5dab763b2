"""What the planned steps really yielded, speculative and plain apart (stdlib only): the policy's check that
speculation, as it runs it, is not slower than plain decode.

The planner compares plans by predicted rate (expected tokens / predicted seconds). Its curves and acceptance
estimates can be wrong in ways that no one curve shows: a draft catch-up priced spread over rounds that never
come, controller time one curve shares between both kinds of step, a profile taken at other contexts or load.
So every planned decode step is also booked as it ran (tokens emitted, wall seconds), per batch-size bucket and
per kind: plain, or the drafting source whose candidates it verified (a step whose rounds came from several
sources is booked under each). Where a source's steps have measured slower than the plain ones, the policy stops
drafting from it and runs it only as a probe (docs/adaptive.md, Realised rates): a losing draft model does not
silence a winning match.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.adaptive.config import AdaptiveConfig
from scheduler.adaptive.costs import bucket
from scheduler.adaptive.plan import DRAFT, PLAIN


@dataclass
class _Sums:
    """Exponentially weighted sums of one kind of step at one batch-size bucket."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0


@dataclass
class RealizedRates:
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    _sums: dict[tuple[int, str], _Sums] = field(default_factory=dict)  # (batch bucket, kind) -> sums

    def observe(self, num_seqs: int, sources: Iterable[str], tokens: float, seconds: float) -> None:
        """One planned decode step (no prompt chunks): the sources whose candidates it verified (none: plain),
        the tokens it emitted and its wall seconds."""
        if tokens <= 0 or seconds <= 0:
            return
        b, d = bucket(num_seqs), self.config.realized_decay
        for kind in set(sources) or {PLAIN}:
            s = self._sums.setdefault((b, kind), _Sums())
            s.tokens, s.seconds, s.steps = d * s.tokens + tokens, d * s.seconds + seconds, d * s.steps + 1.0

    def rate(self, num_seqs: int, kind: str = DRAFT) -> float | None:
        """Tokens per second of this kind of step (``PLAIN`` or a source) at this batch size; None before
        ``realized_min_steps``."""
        s = self._sums.get((bucket(num_seqs), kind))
        if s is None or s.steps < self.config.realized_min_steps or s.seconds <= 0:
            return None
        return s.tokens / s.seconds

    def loss(self, num_seqs: int, source: str = DRAFT) -> float:
        """Plain steps' worth of time a step drafted from ``source`` loses against plain decode at this batch
        size (0: it does not lose, or either kind is not measured yet): its seconds less those plain decode takes
        for its tokens, over a plain step's seconds."""
        spec, plain = self.rate(num_seqs, source), self.rate(num_seqs, PLAIN)
        if spec is None or plain is None or spec >= plain:
            return 0.0
        s, p = self._sums[bucket(num_seqs), source], self._sums[bucket(num_seqs), PLAIN]
        return (s.seconds / s.steps) * (1.0 - spec / plain) / (p.seconds / p.steps)
