"""Where an engine on one machine listens: loopback only, so nothing on the network can reach its workers.

- Ray: a local cluster (no ``--ray-address``) gets node IP 127.0.0.1, so the GCS, the raylet, the object manager,
  the agents and every worker's gRPC port bind loopback. ``ray.init(_node_ip_address="127.0.0.1")`` is not
  enough: Ray turns a loopback node IP back into the machine's address unless it runs in its single-machine mode
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS and Windows), which is what we select.
- torch.distributed: a group whose ranks share one machine meets at a store listening on 127.0.0.1 (rank 0 binds
  it before handing out the address; PyTorch's own store would listen on every interface), and Gloo / NCCL
  connect their ranks over the loopback interface.

On a cluster (``--ray-address``) the ports must be reachable between nodes: deploy/README.md says which.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

_RAY_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@contextmanager
def ray_on_loopback() -> Iterator[None]:
    """Around ``ray.init`` of a local cluster: its node IP (and so every Ray listener) is 127.0.0.1. Restored
    afterwards, so a later engine in this process can still join a real cluster (the processes Ray started
    keep the setting: they inherited it)."""
    before_env = os.environ.get(_RAY_SINGLE_MACHINE_ENV)
    os.environ[_RAY_SINGLE_MACHINE_ENV] = "0"  # the processes Ray starts read it at import
    try:  # this process may have imported Ray already: the flag was read then
        import ray._private.ray_constants as ray_constants
    except ImportError:
        ray_constants = None
    before_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if ray_constants is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before_env is None:
            os.environ.pop(_RAY_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_RAY_SINGLE_MACHINE_ENV] = before_env
        if ray_constants is not None and before_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = before_flag


def loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def collectives_on_loopback() -> None:
    """Before ``init_process_group`` of ranks on one machine: Gloo and NCCL connect over loopback (unless the
    user chose an interface)."""
    iface = loopback_interface()
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
