"""The controller refuses Ray workers on its own machine that imported another copy of specserve.

Ray puts the driver's working directory first on its workers' sys.path: ``specserve`` (the installed package) run
inside a checkout of another version got that checkout's workers, silently. No Ray here: the executor's check
(engine/execution/code_check.py) runs against stand-in actors and a stand-in ``ray.get``.
"""

from __future__ import annotations

import types

import pytest

from engine.execution.code_check import check_worker_code
from engine.execution.worker_actor import code_root


class _Remote:
    def __init__(self, value):
        self.value = value

    def remote(self):
        return self.value


def _check(monkeypatch, where: list[tuple[str, str]]) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs, **_: list(refs))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "here"))
    check_worker_code({"target": [types.SimpleNamespace(code=_Remote(w)) for w in where], "draft": []}, ["target"])


def test_workers_with_the_controllers_code_pass(monkeypatch) -> None:
    _check(monkeypatch, [("here", code_root()), ("here", code_root())])


def test_a_worker_importing_another_copy_is_refused_by_name(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match=r"target worker rank 1 imports specserve from /elsewhere/checkout"):
        _check(monkeypatch, [("here", code_root()), ("here", "/elsewhere/checkout")])


def test_workers_on_other_nodes_may_install_it_elsewhere(monkeypatch) -> None:
    _check(monkeypatch, [("here", code_root()), ("other-node", "/opt/venv/site-packages")])
