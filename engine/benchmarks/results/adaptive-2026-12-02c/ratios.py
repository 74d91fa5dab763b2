import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path + "/sweep.json"))
    rows = {c["name"]: {p["load"]: p for p in c["points"]} for c in d["configs"]}
    conc = sorted(rows["nospec"])
    thr = {n: [rows[n][c]["result"]["output_throughput"] for c in conc] for n in rows}
    print("==", path, "concurrency", conc)
    for n, v in thr.items(): print(f"{n:8s}", [round(x, 1) for x in v], "runs", [[round(y) for y in rows[n][c]["repeats_output_throughput"]] for c in conc])
    r = lambda a, b: [round(x / y, 2) for x, y in zip(thr[a], thr[b])]
    print("default/k4    ", r("default", "k4"))
    print("default/nospec", r("default", "nospec"))
    print("k4/nospec     ", r("k4", "nospec"))
