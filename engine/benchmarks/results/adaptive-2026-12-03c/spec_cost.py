"""What the speculative steps of a traced server gained or lost against decoding plainly (trace_site's format).

For every step that ran candidates (an exploration, or a bet the policy chose), the seconds plain decode would
have needed for the tokens it emitted, at the pace of the plain steps of the same batch size around it (up to 6
either side, so the machine's drift cancels), minus the seconds it took. Summed per kind and batch size (under 16
or not: the sweep's warm-up requests run alone), as a share of the server's traced time; and each server's median
plain step at its most common batch size (the servers of one interleaved sweep side by side: the plain step of a
speculating configuration should cost what no speculation's does).

    python spec_cost.py /tmp/sw/trace     # reads /tmp/sw/trace.<pid> for every server
"""

import glob
import statistics
import sys
from collections import Counter

for f in sorted(glob.glob(sys.argv[1] + ".*")):
    rows = []
    for line in open(f):
        head = line.split("|")[0].split()
        rows.append((float(head[1]), *map(int, head[2:8])))  # seconds, rounds, prefill, nodes, spec, explored, out
    if not rows:
        continue
    total = sum(r[0] for r in rows)
    plain = [r for r in rows if not r[2] and not r[3]]
    top = Counter(r[1] for r in plain).most_common(1)
    gained: Counter = Counter()  # (kind, batch >= 16) -> seconds gained against plain decode
    steps: Counter = Counter()
    for i, (dur, rounds, prefill, nodes, _, explored, emitted) in enumerate(rows):
        if not nodes or prefill:
            continue
        near = [x[0] for x in rows[max(0, i - 6):i + 7] if not x[2] and not x[3] and x[1] == rounds]
        if not near:
            continue
        kind = ("explore" if explored else "bet", "b>=16" if rounds >= 16 else "b<16")
        gained[kind] += emitted * statistics.median(near) / rounds - dur
        steps[kind] += 1
    line = f"{f.split('/')[-1]}: {len(rows)} steps {total:.1f} s"
    if top:
        b = top[0][0]
        line += f"; plain b{b}: {statistics.median(r[0] for r in plain if r[1] == b) * 1000:.0f} ms median"
    for kind in sorted(steps):
        line += (f"; {' '.join(kind)} {steps[kind]} steps {gained[kind]:+.2f} s "
                 f"({100 * gained[kind] / total:+.1f} %)")
    print(line)
