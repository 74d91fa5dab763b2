"""One process per data directory: an OS file lock that dies with its holder."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def claim_dir(root: Path, name: str) -> int:
    """Lock ``root/name`` for this process and write its pid there; returns the descriptor to keep open.

    Raises RuntimeError naming the holder's pid when another process has it. An OS lock, so a killed holder
    leaves nothing to clean up.
    """
    fd = os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RuntimeError(f"--data-dir {root} is in use by another specserve server (pid {holder}); "
                           "give each server its own --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
