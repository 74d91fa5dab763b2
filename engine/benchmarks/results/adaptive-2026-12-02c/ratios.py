"""Out tok/s per rung and the ratios of README.md: python ratios.py SWEEP_DIR ..."""

import json
import sys


def ratio(thr: dict[str, list[float]], a: str, b: str) -> list[float]:
    return [round(x / y, 2) for x, y in zip(thr[a], thr[b], strict=True)]


for path in sys.argv[1:]:
    with open(path + "/sweep.json") as f:
        d = json.load(f)
    rows = {c["name"]: {p["load"]: p for p in c["points"]} for c in d["configs"]}
    conc = sorted(rows["nospec"])
    thr = {n: [rows[n][c]["result"]["output_throughput"] for c in conc] for n in rows}
    print("==", path, "concurrency", conc)
    for n, v in thr.items():
        runs = [[round(y) for y in rows[n][c]["repeats_output_throughput"]] for c in conc]
        print(f"{n:8s}", [round(x, 1) for x in v], "runs", runs)
    print("default/k4    ", ratio(thr, "default", "k4"))
    print("default/nospec", ratio(thr, "default", "nospec"))
    print("k4/nospec     ", ratio(thr, "k4", "nospec"))
