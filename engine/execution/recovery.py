"""Keep going when a worker dies: rebuild the failed role's worker group and re-prefill what was in flight.

On a ``WorkerDiedError`` the engine hands the error here (one hook in ``LLMEngine.step``):

1. The step is abandoned. A call still in flight to the *other* role is waited for and its reply dropped
   (noticing if that role died too), so no stale reply can answer a later call.
2. The restart budget is checked: at most ``max_worker_restarts`` failures per ``worker_restart_window_s``;
   one more and the engine stops with ``TooManyRestartsError`` naming every failure.
3. The dead role's actors are killed, its placement group re-created (a rank on a lost node lands wherever
   the cluster has room; a plan that no longer fits fails with what is missing) and new ranks started, which
   form a new torch.distributed group.
   - target: the engine waits for it, then every running request is re-queued with no KV (the scheduler's
     counters and block pools are rebuilt from the requests: scheduler/reset.py) and re-prefilled from its
     committed tokens, prompt + output so far.
   - draft: optional. The engine decodes without speculation while the draft starts in the background; once
     it is up, the draft is refilled from every running request's committed tokens and speculation resumes.

Outputs: greedy output is the target's argmax chain, so it is identical to a run without the fault. Seeded
sampling draws from streams keyed by (seed, position) (workers/streams.py), so a request re-prefilled after a
*target* restart continues exactly its stream. A seeded sampled request's tokens also depend on the draft's
proposals, which only a draft can repeat: while the draft is down such requests are held (no decode rounds,
their KV kept; ``LLMEngine._needs_draft``) and go on once the replacement, drawing its trees from the same
(seed, position) streams, is up. Greedy and unseeded requests decode without speculation meanwhile.

Held requests never wait forever: a replacement that is not up within ``draft_start_timeout_s`` counts as one
more failure (and is started again), so a draft that cannot come back ends in ``TooManyRestartsError``, which
stops the engine like any exhausted budget.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.execution.faults import TooManyRestartsError, WorkerDiedError
from engine.execution.role import Role
from scheduler.reset import forget_cached


class RestartableExecutor(Protocol):
    """An executor whose workers can be replaced (Ray actors, a draft process)."""

    step_timeout_s: float  # also how long a replacement draft may take to start

    def in_flight(self) -> list[Role]: ...

    def discard_in_flight(self, role: Role) -> None: ...

    def wait_target(self) -> Any: ...

    def wait_draft(self) -> Any: ...

    def begin_restart(self, role: Role) -> None: ...

    def finish_restart(self, role: Role, block: bool) -> bool: ...


class RecoveringEngine(Protocol):
    """What recovery needs of the engine: its executor, and the two hooks that drop and refill worker state."""

    @property
    def executor(self) -> RestartableExecutor: ...

    def lose_worker_state(self, role: Role) -> None: ...

    def resume_draft(self) -> None: ...


@dataclass
class RecoveryStats:
    restarts: dict[str, int] = field(default_factory=dict)  # role -> worker groups restarted
    recovery_s: list[float] = field(default_factory=list)  # per restart: noticed -> serving again
    detect_wait_s: list[float] = field(default_factory=list)  # per failure: how long the noticing wait ran
    failures: list[str] = field(default_factory=list)
    noticed_at: list[float] = field(default_factory=list)  # time.monotonic() of each failure's notice

    @property
    def worker_restarts_total(self) -> int:
        return sum(self.restarts.values())

    def as_dict(self) -> dict:
        return {"worker_restarts_total": self.worker_restarts_total, "restarts_by_role": dict(self.restarts),
                "recovery_s": [round(s, 3) for s in self.recovery_s],
                "detect_wait_s": [round(s, 3) for s in self.detect_wait_s], "failures": list(self.failures)}


class RecoveryCollector:
    """Prometheus adapter: ``registry.register(RecoveryCollector(engine.recovery.stats))``."""

    def __init__(self, stats: RecoveryStats) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily

        c = CounterMetricFamily("specserve:worker_restarts", "Worker groups restarted after a worker died",
                                labels=["role"])
        for role, n in sorted(self.stats.restarts.items()):
            c.add_metric([role], n)
        yield c
        s = self.stats.recovery_s
        yield SummaryMetricFamily("specserve:worker_recovery_seconds",
                                  "From noticing a dead worker to its replacement serving", count_value=len(s),
                                  sum_value=sum(s))


class Recovery:
    def __init__(self, engine: RecoveringEngine, max_restarts: int, window_s: float) -> None:
        self.engine = engine
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.stats = RecoveryStats()
        self._recent: deque[tuple[float, str]] = deque()  # (time, description) of failures in the window
        self._restarting: dict[Role, float] = {}  # role started in the background -> when it was noticed
        self._started: dict[Role, float] = {}  # role started in the background -> when its replacement began
        self.draft_start_timeout_s = engine.executor.step_timeout_s
        self._recovering: Role | None = None  # the role ``recover`` is rebuilding now (the step is blocked on it)

    @property
    def _scheduler(self) -> Any:
        """The engine's scheduler, whose pools' prefix caches a lost worker takes with it (None: an engine
        without one, as recovery's own tests fake it)."""
        return getattr(self.engine, "scheduler", None)

    @property
    def degraded(self) -> bool:
        """A role is being restarted (the draft: the engine decodes without speculation meanwhile)."""
        return bool(self._restarting)

    @property
    def restoring(self) -> tuple[str, ...]:
        """Roles being restored now: one the step waits for, or a draft starting in the background. A read-only
        snapshot for another thread (the server's ``/health``) while the engine's own thread is inside a step."""
        roles = set(list(self._restarting))  # list(dict) copies under the GIL: no "changed size" error
        recovering = self._recovering
        if recovering is not None:
            roles.add(recovering)
        return tuple(sorted(roles))

    def recover(self, err: WorkerDiedError) -> None:
        """Rebuild what died; raises TooManyRestartsError past the budget, RuntimeError if it cannot be placed."""
        noticed = time.monotonic()
        self.stats.noticed_at.append(noticed)
        executor = self.engine.executor
        self._recovering = err.role
        try:
            dead = [err]
            for role in executor.in_flight():
                if role == err.role:
                    executor.discard_in_flight(role)
                    continue
                try:
                    getattr(executor, f"wait_{role}")()  # an abandoned step's reply: dropped
                except WorkerDiedError as e:
                    if e.role != err.role:  # the target's reply may name the dead draft again (its laws): once
                        dead.append(e)
            while dead:
                e = dead.pop(0)
                self._recovering = e.role
                self._admit(e)
                try:
                    self._restart(e.role, noticed)
                except WorkerDiedError as again:  # the replacement died while starting
                    dead.append(again)
        finally:
            self._recovering = None

    def poll(self) -> None:
        """Between steps: bring a restarted draft back into service once it has loaded."""
        started = self._restarting.get(Role.DRAFT)
        if started is None:
            return
        try:
            ready = self.engine.executor.finish_restart(Role.DRAFT, block=False)
        except RuntimeError as e:
            del self._restarting[Role.DRAFT]
            self.recover(WorkerDiedError(Role.DRAFT, None, f"its replacement failed to start: {e}"))
            return
        took = time.monotonic() - self._started[Role.DRAFT]
        if not ready and took > self.draft_start_timeout_s:
            del self._restarting[Role.DRAFT]
            self.recover(WorkerDiedError(Role.DRAFT, None, f"its replacement was not up after {took:.0f} s "
                                         "(--step-timeout)"))
            return
        if ready:
            try:
                forget_cached(self._scheduler, target=False)  # blocks offered while it was down are empty
                self.engine.resume_draft()
            except WorkerDiedError as e:  # the replacement died while its cache was refilled: once more
                del self._restarting[Role.DRAFT]
                self.recover(e)
                return
            del self._restarting[Role.DRAFT]
            self.stats.recovery_s.append(time.monotonic() - started)

    def _admit(self, err: WorkerDiedError) -> None:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        self._recent.append((now, str(err)))
        self.stats.failures.append(str(err))
        waited = getattr(err, "waited_s", None)
        if waited is not None:
            self.stats.detect_wait_s.append(waited)
        if len(self._recent) > self.max_restarts:
            raise TooManyRestartsError([d for _, d in self._recent], self.max_restarts, self.window_s) from err

    def _restart(self, role: Role, noticed: float) -> None:
        executor = self.engine.executor
        self._restarting.pop(role, None)
        executor.begin_restart(role)  # RuntimeError if the plan no longer fits the cluster: not retried
        self.stats.restarts[role] = self.stats.restarts.get(role, 0) + 1
        self.engine.lose_worker_state(role)
        forget_cached(self._scheduler, target=role == Role.TARGET)  # the new worker's cache is empty
        if role == Role.DRAFT:
            self._restarting[role] = noticed
            self._started[role] = time.monotonic()
            return
        try:
            executor.finish_restart(role, block=True)
        except RuntimeError as e:
            raise WorkerDiedError(role, None, f"its replacement failed to start: {e}") from e
        self.stats.recovery_s.append(time.monotonic() - noticed)
