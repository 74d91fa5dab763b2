"""Every constant of the adaptive speculation policy, named, one line each on what it trades (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AdaptiveConfig:
    # Planning.
    hysteresis: float = 0.05  # a change (plan, pipelining mode) must win by this much: stability vs reaction
    spec_margin: float = 0.05  # speculating must be predicted this much faster than plain decode: cost errors vs gains
    min_rounds: int = 4  # opening rounds a regime runs before it is planned: evidence vs their cost where they lose
    open_depth: int = 2  # ... as a chain this deep (not the configured tree): their cost vs evidence deeper down
    search_prices: int = 16  # prefixes the planner prices per depth cap: its own time vs a finer search
    # Acceptance estimates (per position, regime and kind; exponentially weighted counts).
    prior_rate: float = 0.7  # a position's rate before anything is measured (the first position's prior)
    prior_weight: float = 2.0  # rounds the prior is worth
    acceptance_decay: float = 0.995  # memory (~200 rounds): reaction vs noise
    idle_decay: float = 0.99  # ... of a depth no round reaches: retry a depth vs forget a miss slowly
    # Cost curves (seconds per log2 bucket of a size).
    curve_decay: float = 0.1  # weight of a new measurement per step since its bucket was measured: noise vs drift
    curve_max_jump: float = 0.5  # the most one measurement moves a bucket: one slow step vs a real change
    # Realised rates (scheduler/adaptive/realized.py): predictions checked against what the steps yielded.
    realized_decay: float = 0.9  # memory (~10 steps of a kind): reaction to a changed workload vs noise
    realized_min_steps: float = 3.0  # steps of each kind measured before speculation can be found slower
    probe_backoff: float = 2.0  # a probe of vetoed speculation that loses again stretches the next interval this
    #   much: what probing costs where speculation keeps losing vs reacting to a new workload ...
    probe_every: int = 128  # ... up to this many steps apart (a workload that starts accepting waits at most this)
    # Exploration (shared by the plan's sizes and the pipelining switch).
    explore_budget: float = 0.03  # share of the time exploring may cost when the prediction is right
    explore_min: int = 8  # steps between explorations of one thing, at least: cheap explorations vs churn
    explore_every: int = 256  # ... at most: stale curves vs exploration cost
    # Start-up profiling and the profile cache.
    profile_prompt_len: int = 8  # dummy prompt tokens: decode costs hardly depend on the context length
    profile_max_batch: int = 256  # larger batch sizes are priced by extrapolating the curves
    profile_rounds: int = 4  # rounds per dummy group after the two not learned from (prefill, first round)
    profile_max_age_s: float = 7 * 24 * 3600  # a cached profile older than this is measured again (load, drift)
    # Pipelining switch.
    switch_samples: int = 3  # steady steps of each mode before the first choice: evidence vs early gains
    switch_give_up: float = 1.3  # ... unless a pipelined one already costs this many times a sequential one
    switch_burst: int = 3  # steps of a burst of the other mode (the first is a transition): evidence vs cost
    switch_keep: float = 0.8  # decay of a mode's cost sums per sample of it: reaction vs noise
    switch_age: float = 0.97  # ... and per sample of the other mode: a rarely run mode's old steps fade

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ValueError(f"adaptive config: {f.name} must be a non-negative number, got {v!r}")
        for name in ("acceptance_decay", "idle_decay", "realized_decay", "curve_decay", "curve_max_jump",
                     "explore_budget", "switch_keep", "switch_age"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"adaptive config: {name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.explore_min > min(self.explore_every, self.probe_every):
            raise ValueError(f"adaptive config: explore_min ({self.explore_min}) exceeds explore_every "
                             f"({self.explore_every}) or probe_every ({self.probe_every})")
        if self.probe_backoff < 1:
            raise ValueError(f"adaptive config: probe_backoff must be at least 1, got {self.probe_backoff!r}")
        if self.switch_burst < 2 or self.switch_samples < 1:
            raise ValueError("adaptive config: switch_burst must be at least 2 (its first step is a transition) "
                             "and switch_samples at least 1")
