"""A sweep's results for people: a markdown table (low-load latency and saturation throughput per
configuration, side by side, with ratios to the first configuration) and matplotlib plots (output tok/s vs
load, TPOT p50/p95 vs load, TTFT CDF at low load and at the knee, acceptance by position).

Input: the sweep's JSON dict (``configs``: each with ``name``, ``points`` [{``load``, ``result``}], ``knee``).
"""

from __future__ import annotations

import math
import os
from typing import Any


def fmt(v: Any, nd: int = 1) -> str:
    """A number for a table or a log line; '-' where there is none (no streamed token: no TTFT)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _load_label(x: Any) -> str:
    return "inf" if x == "inf" or (isinstance(x, float) and math.isinf(x)) else f"{x:g}"


def knee_point(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The point at the knee, or the highest load when the ladder never saturated."""
    pts = cfg.get("points") or []
    if not pts:
        return None
    k = (cfg.get("knee") or {}).get("index")
    return pts[k] if k is not None else pts[-1]


def acceptance_by_position(cfg: dict[str, Any]) -> list[float] | None:
    """Per-position acceptance rate over every point of a configuration (accepted at i / drafts)."""
    drafts, acc = 0, []
    for p in cfg.get("points") or []:
        sd = p["result"].get("spec_decode")
        if not sd or not sd.get("num_drafts"):
            continue
        drafts += sd["num_drafts"]
        per = sd.get("accepted_per_position") or []
        n = max(len(acc), len(per))
        acc = [a + b for a, b in zip(acc + [0] * (n - len(acc)), list(per) + [0] * (n - len(per)), strict=True)]
    return [a / drafts for a in acc] if drafts else None


def mean_acceptance_length(cfg: dict[str, Any]) -> float | None:
    drafts = accepted = 0
    for p in cfg.get("points") or []:
        sd = p["result"].get("spec_decode") or {}
        drafts += sd.get("num_drafts") or 0
        accepted += sd.get("accepted_tokens") or 0
    return 1.0 + accepted / drafts if drafts else None


def markdown(sweep: dict[str, Any]) -> str:
    kind = sweep["ladder"]["kind"]
    cfgs = [c for c in sweep["configs"] if c.get("points")]
    lines = [f"Ladder: {kind} {', '.join(_load_label(v) for v in sweep['ladder']['values'])}. "
             "Low load = the first rung; saturation = the highest output throughput on the ladder; knee = where "
             "it stops rising. Ratios are to the first configuration (> 1: better).", ""]
    lines += ["| config | TTFT p50 ms | TPOT p50 ms | TPOT p95 ms | ITL p50 ms | E2EL p50 ms | low-load speedup "
              "(TPOT) | knee (" + kind + ") | saturation out tok/s | × | req/s | accept len | failed |",
              "|" + "---|" * 13]
    base = cfgs[0] if cfgs else None
    for c in cfgs:
        low = c["points"][0]["result"]
        best = max(c["points"], key=lambda p: p["result"]["output_throughput"])["result"]
        b_low = base["points"][0]["result"]
        b_best = max(p["result"]["output_throughput"] for p in base["points"])
        speed = (b_low["median_tpot_ms"] / low["median_tpot_ms"]
                 if low.get("median_tpot_ms") and b_low.get("median_tpot_ms") else None)
        ratio = best["output_throughput"] / b_best if b_best else None
        knee = c.get("knee") or {}
        knee_s = _load_label(knee["load"]) if knee.get("load") is not None else "not reached"
        failed = sum(p["result"]["failed"] for p in c["points"])
        lines.append(f"| {c['name']} | {fmt(low.get('median_ttft_ms'))} | {fmt(low.get('median_tpot_ms'))} | "
                     f"{fmt(low.get('p95_tpot_ms'))} | {fmt(low.get('median_itl_ms'))} | "
                     f"{fmt(low.get('median_e2el_ms'), 0)} | {fmt(speed, 2)} | {knee_s} | "
                     f"{fmt(best['output_throughput'])} | {fmt(ratio, 2)} | {fmt(best['request_throughput'], 2)} | "
                     f"{fmt(mean_acceptance_length(c), 2)} | {failed} |")
    for c in sweep["configs"]:
        if c.get("error"):
            lines.append(f"\n{c['name']}: failed: {c['error'].splitlines()[0]}")
    lines += ["", "Every rung:", "",
              f"| config | {kind} | out tok/s | req/s | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 | "
              "queue (mean waiting) | accept len | mean K | failed |", "|" + "---|" * 12]
    for c in cfgs:
        for p in c["points"]:
            r = p["result"]
            sd = r.get("spec_decode") or {}
            q = (r.get("server_load") or {}).get("mean_waiting")
            lines.append(f"| {c['name']} | {_load_label(p['load'])} | {fmt(r['output_throughput'])} | "
                         f"{fmt(r['request_throughput'], 2)} | {fmt(r.get('median_ttft_ms'))} | "
                         f"{fmt(r.get('p95_ttft_ms'))} | {fmt(r.get('median_tpot_ms'))} | "
                         f"{fmt(r.get('p95_tpot_ms'))} | {fmt(q)} | "
                         f"{fmt(sd.get('mean_acceptance_length'), 2)} | {fmt(sd.get('mean_chosen_depth'), 2)} | "
                         f"{r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(sweep: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    kind = sweep["ladder"]["kind"]
    values = sweep["ladder"]["values"]
    xlabels = [_load_label(v) for v in values]
    cfgs = [c for c in sweep["configs"] if c.get("points")]
    paths = []

    def save(fig, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    def xs(c: dict[str, Any]) -> list[int]:  # rungs at even spacing: the ladder is roughly geometric, may hold inf
        return [xlabels.index(_load_label(p["load"])) for p in c["points"]]

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in cfgs:
        ys = [p["result"]["output_throughput"] for p in c["points"]]
        (line,) = ax.plot(xs(c), ys, marker="o", label=c["name"])
        k = (c.get("knee") or {}).get("index")
        if k is not None:
            ax.plot([xs(c)[k]], [ys[k]], marker="*", markersize=14, color=line.get_color())
    ax.set(xlabel=kind, ylabel="output tokens/s", title="Output throughput vs load (* = knee)")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in cfgs:
        (line,) = ax.plot(xs(c), [p["result"].get("median_tpot_ms") for p in c["points"]], marker="o",
                          label=f"{c['name']} p50")
        ax.plot(xs(c), [p["result"].get("p95_tpot_ms") for p in c["points"]], linestyle="--", marker="x",
                color=line.get_color(), label=f"{c['name']} p95")
    ax.set(xlabel=kind, ylabel="TPOT ms", title="Time per output token vs load")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "tpot.png")

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, which in zip(axes, ("low load", "the knee"), strict=True):
        for c in cfgs:
            p = c["points"][0] if which == "low load" else knee_point(c)
            no_knee = which == "the knee" and (c.get("knee") or {}).get("index") is None
            t = sorted(x["ttft"] * 1000 for x in p["result"]["requests"] if x["success"] and x["ttft"] is not None)
            if t:
                ax.step([0.0] + t, [0.0] + [(i + 1) / len(t) for i in range(len(t))], where="post",
                        label=f"{c['name']} ({kind} {_load_label(p['load'])}{', no knee: top rung' * no_knee})")
        ax.set(xlabel="TTFT ms", title=f"TTFT CDF at {which}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    axes[0].set_ylabel("fraction of requests")
    save(fig, "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [(c["name"], acceptance_by_position(c)) for c in cfgs]
    rates = [(n, r) for n, r in rates if r]
    width = 0.8 / max(1, len(rates))
    for j, (name, r) in enumerate(rates):
        ax.bar([i + (j - (len(rates) - 1) / 2) * width for i in range(len(r))], r, width=width, label=name)
    if rates:
        ax.set_xticks(range(max(len(r) for _, r in rates)))
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative-decoding counters", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="draft position", ylabel="accepted / drafts", title="Acceptance by position", ylim=(0, 1.05))
    save(fig, "acceptance.png")
    return paths
