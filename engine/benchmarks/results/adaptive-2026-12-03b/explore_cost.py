"""Per trace file: steps, total seconds, exploration steps and the time they cost over the plain steps around them."""
import sys, statistics, glob
for f in sorted(glob.glob(sys.argv[1] + '.*')):
    rows = []
    for line in open(f):
        head = line.split('|')[0].split()
        t0, dur, rounds, prefill, nodes, spec, expl, emitted = float(head[0]), float(head[1]), *map(int, head[2:8])
        rows.append((t0, dur, rounds, prefill, nodes, spec, expl, emitted, 'PRED' in line))
    if not rows: continue
    total = sum(r[1] for r in rows)
    ex = [i for i, r in enumerate(rows) if r[6]]
    lost = 0.0
    details = []
    for i in ex:
        r = rows[i]
        near = [x[1] for x in rows[max(0, i-6):i+7] if not x[6] and not x[3] and x[4] == 0 and x[2] == r[2]]
        base = statistics.median(near) if near else float('nan')
        # emitted tokens beyond the plain step's one per request count as gain
        gain = (r[7] - r[2]) * (base / r[2]) if near else 0
        lost += r[1] - base - gain if near else 0
        details.append(f"{r[2]}req nodes{r[4]} spec{r[5]} {r[1]:.2f}s vs {base:.2f}")
    spec_steps = sum(1 for r in rows if r[4] and not r[6])
    print(f"{f.split('/')[-1]}: {len(rows)} steps {total:.1f}s, spec(non-explore) steps {spec_steps}, "
          f"explorations {len(ex)} lost {lost:.2f}s ({100*lost/total:.1f}%)")
    for d in details[:12]: print("   ", d)
