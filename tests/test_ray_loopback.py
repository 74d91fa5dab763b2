"""``specserve serve --tensor-parallel-size 2`` with default flags (a local Ray cluster, two target ranks in a
Gloo group, the draft worker): while it serves, no process of it listens on anything but loopback — not
Ray's GCS, raylet, agents or worker gRPC ports, not the torch.distributed store, not Gloo, not the server."""

from __future__ import annotations

import os

import httpx
import psutil
import pytest

from engine.execution.loopback import is_loopback, ray_on_loopback
from tests.helpers_server import SubprocessServer


def _listeners(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket of ``root`` and its descendants."""
    procs = {root: psutil.Process(root)}
    procs.update({p.pid: p for p in procs[root].children(recursive=True)})
    out = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = " ".join(procs[c.pid].cmdline())[:100]
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


def test_the_loopback_choice_lasts_only_for_the_local_clusters_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside: Ray takes this node to be 127.0.0.1. After: as before, so a later engine in the same process can
    still join a real cluster at the machine's address."""
    import ray

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    if ray.is_initialized():
        pytest.skip("a Ray driver is already running in this process")
    before = ray.util.get_node_ip_address()
    with ray_on_loopback():
        assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert ray.util.get_node_ip_address() == before
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ


@pytest.mark.slow  # a server with a Ray cluster and three worker processes
def test_a_tp2_server_listens_on_loopback_only() -> None:
    srv = SubprocessServer("--tensor-parallel-size", "2", env={"OMP_NUM_THREADS": "1"})
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "def f():", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        listening = _listeners(srv.proc.pid)
        assert len(listening) >= 5, listening  # the server, Ray's GCS and raylet, the workers, the store
        exposed = [x for x in listening if not is_loopback(x[0])]
        assert not exposed, exposed
    finally:
        assert srv.stop() in (0, 15, -15) and "Traceback" not in srv.stderr, srv.stderr[-3000:]
