"""The target's hidden states an EAGLE head reads, from the verify pass to the draft worker.

The target captures the chosen layers (``EagleHeadConfig.aux_layers``) in every forward, and after verification
keeps only the rows whose tokens are now real: every row of a prompt chunk, the in-flight tokens and the accepted
path of a round (``committed_rows``). They go to where the head runs, never through the controller; in-process
the target puts them into the draft worker's ``FeatureStore``.

What crosses per round is small next to the laws: rows x feature width x 4 bytes (the built-in target: 3 x 320
floats, 3.8 kB a row; Llama-3-8B: 3 x 4096, 48 kB a row), against a [nodes, vocab] law table per sampled tree.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SeqFeatures:
    """Feature rows of one sequence for positions start, start + 1, ... (committed target tokens)."""

    seq_id: int
    start: int
    rows: torch.Tensor  # [n, feature_size]


FeatureSink = Callable[[list[SeqFeatures], list[int]], None]  # (committed rows, finished sequence ids)


def committed_rows(piece_rows: list[int], num_inflight: list[int], accepted: list[list[int] | None]
                   ) -> list[list[int]]:
    """Rows of the flattened forward to keep, per piece: piece i has ``piece_rows[i]`` rows laid out as
    [in-flight tokens (``num_inflight[i]``), then tree nodes]; ``accepted[i]``: its accepted tree nodes, None for
    a prompt chunk (every row is committed)."""
    out: list[list[int]] = []
    at = 0
    for n, u, acc in zip(piece_rows, num_inflight, accepted, strict=True):
        out.append(list(range(at, at + n)) if acc is None else list(range(at, at + u)) + [at + u + j for j in acc])
        at += n
    return out


@dataclass
class FeatureStore:
    """The draft side: each sequence's feature rows for the positions it has not drafted past yet."""

    # How long a take waits for rows still on the way (Ray: a socket from target rank 0; the draft's step may start
    # first). In-process the target has put them before the draft's step: nothing to wait for.
    timeout_s: float = 0.0
    _rows: dict[int, SeqFeatures] = field(default_factory=dict)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    bytes_in: int = 0  # every row put, in bytes (what crosses: measured, docs/architecture.md)
    _error: str | None = None  # the receiver failed: a take stops waiting and says why

    def fail(self, error: str) -> None:
        """The rows cannot arrive any more (their receiver died): waiting takes raise now, not at the timeout."""
        with self._lock:
            self._error = error
            self._lock.notify_all()

    def put(self, feats: list[SeqFeatures], finished: list[int] | None = None) -> None:
        """New rows replace any held at or after their start (a re-prefilled sequence starts over); ``finished``
        sequences are forgotten. The target says which: it alone knows finished from preempted (a preempted
        sequence comes back under its id, re-prefilled, perhaps before the draft hears it was preempted)."""
        with self._lock:
            for s in finished or []:
                self._rows.pop(s, None)
            for f in feats:
                self.bytes_in += f.rows.numel() * f.rows.element_size()
                old = self._rows.get(f.seq_id)
                if old is None or f.start <= old.start or f.start > old.start + old.rows.shape[0]:
                    self._rows[f.seq_id] = SeqFeatures(f.seq_id, f.start, f.rows)
                else:
                    keep = old.rows[: f.start - old.start]
                    self._rows[f.seq_id] = SeqFeatures(f.seq_id, old.start, torch.cat([keep, f.rows]))
            self._lock.notify_all()

    def take(self, seq_id: int, start: int, stop: int, width: int, device: torch.device) -> torch.Tensor:
        """Rows for positions [start, stop) as [stop - start, width] (position -1: zeros, the first token has no
        feature); rows before ``start`` are forgotten (drafting never goes back past its committed tokens)."""
        lo = max(start, 0)

        def missing(f: SeqFeatures | None) -> bool:
            return stop > lo and (f is None or lo < f.start or stop > f.start + f.rows.shape[0])

        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while missing(self._rows.get(seq_id)) and self._error is None and time.monotonic() < deadline:
                self._lock.wait(min(deadline - time.monotonic(), 1.0))
            f = self._rows.get(seq_id)
            if missing(f) and self._error is not None:
                raise RuntimeError(f"EAGLE features of sequence {seq_id} cannot arrive: {self._error}")
            if missing(f):
                held = "none" if f is None else f"[{f.start}, {f.start + f.rows.shape[0]})"
                raise RuntimeError(f"EAGLE features of sequence {seq_id} for positions [{lo}, {stop}) are not here "
                                   f"(held: {held}); the target sends them with every verified round")
            rows = f.rows[lo - f.start: stop - f.start] if f is not None and stop > lo else \
                torch.empty(0, width)
            if f is not None and lo > f.start:
                self._rows[seq_id] = SeqFeatures(seq_id, lo, f.rows[lo - f.start:])
        pad = torch.zeros(lo - start, width)
        return torch.cat([pad, rows.to(pad.dtype)]).to(device) if lo > start else rows.to(device)

    def __len__(self) -> int:
        return len(self._rows)
