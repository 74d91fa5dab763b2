"""The saturation knee of a load ladder: where output throughput stops rising while latency and the queue keep
climbing.

Points are ordered by offered load (concurrency, or request rate). The knee is the first point whose
throughput no later point beats by more than ``tolerance`` (relative): past it, more load buys (almost) no more
tokens per second. It needs at least one point beyond it, as evidence; a ladder whose throughput still rises
at its last point has no knee (not saturated). Whether TTFT or the server's queue grew beyond the knee is
reported beside it: a plateau with flat latency would mean the load never really rose (for instance a client
that could not send faster), not a saturated server.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Knee:
    index: int | None  # position in the ladder; None: not saturated within it
    load: float | None
    output_throughput: float | None  # at the knee
    max_output_throughput: float  # over the whole ladder
    saturated: bool
    latency_climbing: bool | None  # TTFT (or the queue) higher at the last point than at the knee
    reason: str

    def to_json(self) -> dict:
        return asdict(self)


def find_knee(loads: list[float], throughput: list[float], ttft: list[float | None] | None = None,
              queue: list[float | None] | None = None, tolerance: float = 0.05) -> Knee:
    if len(loads) != len(throughput) or not loads:
        raise ValueError("find_knee needs one throughput per load, and at least one point")
    if any(b <= a for a, b in zip(loads, loads[1:], strict=False)):
        raise ValueError(f"loads must increase along the ladder, got {loads}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    top = max(throughput)
    n = len(loads)
    for i in range(n - 1):
        if max(throughput[i + 1:]) <= throughput[i] * (1.0 + tolerance):
            seen = [c for c in (_climbing(ttft, i, tolerance), _climbing(queue, i, tolerance)) if c is not None]
            climbing = any(seen) if seen else None
            why = (f"throughput at load {loads[i]:g} is within {tolerance:.0%} of every higher load's"
                   + ("" if climbing is None else "; latency/queue climbing beyond it" if climbing
                      else "; but latency and queue did not climb beyond it"))
            return Knee(i, loads[i], throughput[i], top, True, climbing, why)
    return Knee(None, None, None, top, False, None,
                f"throughput still rising at the highest load ({loads[-1]:g}): extend the ladder")


def _climbing(values: list[float | None] | None, i: int, tolerance: float) -> bool | None:
    """Whether the last point's value exceeds the knee's by more than ``tolerance`` (None: not measured)."""
    if values is None or values[i] is None or values[-1] is None:
        return None
    return values[-1] > values[i] * (1.0 + tolerance) + 1e-12


def stop_climbing(loads: list[float], throughput: list[float], points_past_knee: int,
                  tolerance: float = 0.05) -> bool:
    """Whether a ladder run so far has gone ``points_past_knee`` points past its knee (0: never stop early)."""
    if points_past_knee <= 0 or len(loads) < 2:
        return False
    k = find_knee(loads, throughput, tolerance=tolerance)
    return k.index is not None and len(loads) - 1 - k.index >= points_past_knee
