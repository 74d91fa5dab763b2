"""Summarise a step trace of trace_site/sitecustomize.py (diagnostic): per 10 s window the steps, tokens emitted,
tokens per second of engine time, speculative steps and prompt tokens; then the median plain step at the
largest batch per 20 s window (how much the plain steps themselves drift).

usage: python engine/benchmarks/results/adaptive-2026-12-02g/phases.py TRACE_FILE
"""

import collections
import statistics
import sys

# columns: start (epoch s), seconds, decoding requests, prompt tokens, candidate nodes, requests speculating,
# explored (0/1), tokens emitted
rows = [[float(x) for x in line.split()] for line in open(sys.argv[1])]
t0 = rows[0][0]
windows: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0.0])
for start, sec, _batch, prompt, nodes, _spec, _expl, tok in rows:
    w = windows[int((start - t0) // 10)]
    w[0] += 1
    w[1] += tok
    w[2] += nodes > 0
    w[3] += prompt
    w[4] += sec
for k, (steps, tok, spec, prompt, busy) in sorted(windows.items()):
    print(f"{k * 10:5d} s: {steps:4.0f} steps, {tok:5.0f} tokens, {tok / busy if busy else 0:6.1f} tok/s, "
          f"{spec:3.0f} speculative, {prompt:5.0f} prompt tokens")
top = max(int(r[2]) for r in rows)
plain: dict[int, list[float]] = collections.defaultdict(list)
for start, sec, batch, prompt, nodes, *_ in rows:
    if batch == top and prompt == 0 and nodes == 0:
        plain[int((start - t0) // 20)].append(1000 * sec)
print(f"median plain step at batch {top} per 20 s window (ms):",
      " ".join(f"{k * 20}:{statistics.median(v):.0f}" for k, v in sorted(plain.items())))
