"""Per step-trace file (trace_site's format): steps, seconds, speculating steps, and the explorations with the time
they cost over the plain steps of the same batch size around them (their extra tokens credited at that pace).

    python explore_cost.py /tmp/sw/trace     # reads /tmp/sw/trace.<pid> for every server
"""

import glob
import statistics
import sys

for f in sorted(glob.glob(sys.argv[1] + ".*")):
    rows = []
    for line in open(f):
        head = line.split("|")[0].split()
        rows.append((float(head[1]), *map(int, head[2:8])))  # seconds, rounds, prefill, nodes, spec, explored, out
    if not rows:
        continue
    total = sum(r[0] for r in rows)
    lost, details = 0.0, []
    for i, (dur, rounds, _, nodes, spec, explored, emitted) in enumerate(rows):
        if not explored:
            continue
        near = [x[0] for x in rows[max(0, i - 6):i + 7] if not x[5] and not x[2] and not x[3] and x[1] == rounds]
        if not near:
            continue
        base = statistics.median(near)
        lost += dur - base - (emitted - rounds) * base / rounds
        details.append(f"{rounds} req, {nodes} nodes on {spec}: {dur:.2f} s vs {base:.2f}")
    spec_steps = sum(1 for r in rows if r[3] and not r[5])
    print(f"{f.split('/')[-1]}: {len(rows)} steps {total:.1f} s, speculating {spec_steps}, explorations "
          f"{len(details)} lost {lost:.2f} s ({100 * lost / total:.1f} %)")
    for d in details:
        print("   ", d)
