"""Log loss of each per-position acceptance estimate on recorded rounds (``record_rounds.py``): before each round,
the request's predicted rates; scored on every position the round tried. A request is forgotten after its last
round (as the engine does when it finishes).

    python engine/benchmarks/results/adaptive-2026-12-02b/acceptance_logloss.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from scheduler.acceptance import AcceptanceTracker

HERE = Path(__file__).parent
FILES = [("rounds-builtin-greedy.json", True), ("rounds-builtin-t08.json", False),
         ("rounds-smollm2-greedy.json", True)]
K = 8


def log_loss(rows: list[list[int]], greedy: bool, weight: float | None) -> float:
    t = AcceptanceTracker(request_prior_weight=weight)
    last = {sid: i for i, (sid, _, _) in enumerate(rows)}
    total = n = 0.0
    for i, (sid, depth, accepted) in enumerate(rows):
        rates = t.rates(sid, greedy, K, prior=t.engine_rates(greedy, K))
        for j in range(min(accepted + 1, depth)):
            p = min(max(rates[j], 1e-3), 1 - 1e-3)
            total -= math.log(p if j < accepted else 1 - p)
            n += 1
        t.observe(sid, greedy, False, depth, accepted)
        if last[sid] == i:
            t.forget(sid)
    return total / n


def main() -> None:
    weights: list[float | None] = [2.0, 4.0, 8.0, 16.0, 32.0, 1e9, None]
    print("file", *("learned" if w is None else "engine only" if w > 1e6 else f"w={w:g}" for w in weights), sep=" | ")
    for name, greedy in FILES:
        rows = json.loads((HERE / name).read_text())
        print(name, *(f"{log_loss(rows, greedy, w):.4f}" for w in weights), sep=" | ")


if __name__ == "__main__":
    main()
