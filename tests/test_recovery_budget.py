"""The restart budget and the order of a recovery (engine/execution/recovery.py), with a stand-in engine: no Ray."""

from __future__ import annotations

import pytest

from engine.execution.faults import TooManyRestartsError, WorkerDiedError
from engine.execution.recovery import Recovery


class FakeExecutor:
    step_timeout_s = 600.0  # recovery's limit for a replacement draft to start

    def __init__(self, in_flight: list[str], other_dies: bool = False) -> None:
        self.calls: list[str] = []
        self._in_flight = list(in_flight)
        self.other_dies = other_dies
        self.ready = False

    def in_flight(self) -> list[str]:
        return list(self._in_flight)

    def discard_in_flight(self, role: str) -> None:
        self.calls.append(f"discard {role}")

    def wait_draft(self):
        self.calls.append("drain draft")
        if self.other_dies:
            raise WorkerDiedError("draft", 0, "gone too")

    def begin_restart(self, role: str) -> None:
        self.calls.append(f"begin {role}")

    def finish_restart(self, role: str, block: bool) -> bool:
        self.calls.append(f"finish {role}{' (block)' if block else ''}")
        return block or self.ready


class FakeEngine:
    def __init__(self, executor: FakeExecutor) -> None:
        self.executor = executor
        self.lost: list[str] = []
        self.resumed = 0
        self.refill_dies = False

    def lose_worker_state(self, role: str) -> None:
        self.lost.append(role)

    def resume_draft(self) -> None:
        self.resumed += 1
        if self.refill_dies:
            self.refill_dies = False
            raise WorkerDiedError("draft", 0, "died while refilled")


def test_target_death_drains_the_draft_restarts_the_target_and_requeues() -> None:
    ex = FakeExecutor(in_flight=["target", "draft"])
    eng = FakeEngine(ex)
    rec = Recovery(eng, max_restarts=3, window_s=600)
    rec.recover(WorkerDiedError("target", 1, "killed"))
    assert ex.calls == ["discard target", "drain draft", "begin target", "finish target (block)"]
    assert eng.lost == ["target"] and rec.stats.restarts == {"target": 1} and len(rec.stats.recovery_s) == 1
    assert not rec.degraded


def test_a_second_death_found_while_draining_is_restarted_too() -> None:
    ex = FakeExecutor(in_flight=["target", "draft"], other_dies=True)
    eng = FakeEngine(ex)
    rec = Recovery(eng, max_restarts=3, window_s=600)
    rec.recover(WorkerDiedError("target", 0, "killed"))
    assert rec.stats.restarts == {"target": 1, "draft": 1} and eng.lost == ["target", "draft"]
    assert rec.degraded  # the draft comes back in the background
    rec.poll()
    assert eng.resumed == 0
    ex.ready = True
    rec.poll()
    assert eng.resumed == 1 and not rec.degraded


def test_past_the_budget_the_error_names_every_failure() -> None:
    eng = FakeEngine(FakeExecutor(in_flight=[]))
    rec = Recovery(eng, max_restarts=2, window_s=600)
    rec.recover(WorkerDiedError("target", 1, "first"))
    rec.recover(WorkerDiedError("draft", 0, "second"))
    with pytest.raises(TooManyRestartsError) as err:
        rec.recover(WorkerDiedError("target", 0, "third"))
    msg = str(err.value)
    assert "3 worker failures" in msg and "max_worker_restarts=2" in msg
    for failure in ("target rank 1 died: first", "draft rank 0 died: second", "target rank 0 died: third"):
        assert failure in msg
    assert rec.stats.restarts == {"target": 1, "draft": 1}


def test_failures_older_than_the_window_do_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.execution.recovery as recovery

    now = [1000.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    rec = Recovery(FakeEngine(FakeExecutor(in_flight=[])), max_restarts=1, window_s=60)
    rec.recover(WorkerDiedError("target", 0, "old"))
    now[0] += 61
    rec.recover(WorkerDiedError("target", 0, "new"))  # the old one left the window
    with pytest.raises(TooManyRestartsError):
        rec.recover(WorkerDiedError("target", 0, "too soon"))


def test_a_draft_that_never_comes_back_ends_in_the_budget_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seeded sampled requests wait for the draft (LLMEngine._needs_draft): a replacement that never gets up must
    # not leave them waiting forever. Each overdue start counts as one more failure, until the budget is spent.
    import engine.execution.recovery as recovery

    now = [1000.0]
    monkeypatch.setattr(recovery.time, "monotonic", lambda: now[0])
    ex = FakeExecutor(in_flight=[])  # finish_restart(block=False) never reports ready
    rec = Recovery(FakeEngine(ex), max_restarts=2, window_s=3600)
    rec.draft_start_timeout_s = 100
    rec.recover(WorkerDiedError("draft", 0, "killed"))
    now[0] += 50
    rec.poll()
    assert rec.degraded and rec.stats.restarts == {"draft": 1}  # still within its start time
    now[0] += 51
    rec.poll()  # overdue: started again
    assert rec.stats.restarts == {"draft": 2} and "was not up after 101 s" in rec.stats.failures[-1]
    now[0] += 101
    with pytest.raises(TooManyRestartsError, match="was not up after"):
        rec.poll()


def test_a_draft_that_dies_while_its_cache_is_refilled_is_replaced_again() -> None:
    # resume_draft talks to the new draft (the refill) outside any step: its death there is one more failure to
    # recover from, not an error that stops the engine.
    ex = FakeExecutor(in_flight=[])
    eng = FakeEngine(ex)
    rec = Recovery(eng, max_restarts=3, window_s=600)
    rec.recover(WorkerDiedError("draft", 0, "killed"))
    ex.ready, eng.refill_dies = True, True
    rec.poll()  # up; the refill finds it dead: restarted again
    assert rec.stats.restarts == {"draft": 2} and rec.degraded and "died while refilled" in rec.stats.failures[-1]
    rec.poll()  # the second replacement is up and refilled
    assert eng.resumed == 2 and not rec.degraded and len(rec.stats.recovery_s) == 1
