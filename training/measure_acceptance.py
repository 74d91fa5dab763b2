"""Acceptance of the built-in draft against the built-in target, measured with the specserve engine.

    python -m training.measure_acceptance --models engine/default_models --update-card

For K = 2, 4, 6, 8 chains, greedy and at temperature 0.8, runs the held-out prompts through the engine and
reports the mean acceptance length (tokens per verify round, bonus token included) and the per-position
acceptance rate. ``--update-card`` rewrites the "Acceptance measured with specserve" section of the model card.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

SECTION = "## Acceptance measured with specserve"


def measure(models: Path, ks: list[int], temperatures: list[float], num_prompts: int, max_tokens: int,
            target: str = "target") -> list[dict]:
    from engine import LLM, SamplingParams

    with open(models / "prompts.jsonl", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()][:num_prompts]
    rows = []
    for k in ks:
        llm = LLM(str(models / target), speculative_config={"model": str(models / "draft"),
                                                               "num_speculative_tokens": k})
        for temp in temperatures:
            llm.engine.reset_stats()
            params = [SamplingParams(max_tokens=max_tokens, temperature=temp, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            start = time.perf_counter()
            llm.generate(prompts, params)
            s = llm.engine.stats
            rows.append({"k": k, "temperature": temp, "mean_acceptance_length": round(s.mean_acceptance_length, 3),
                         "acceptance_per_position": [round(a, 3) for a in s.acceptance_per_position],
                         "rounds": s.num_rounds, "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(rows[-1]), flush=True)
        llm.shutdown()
    return rows


def table(rows: list[dict], num_prompts: int, max_tokens: int, command: str) -> str:
    lines = [SECTION, "",
             f"Measured by `{command}` on {num_prompts} held-out prompts, {max_tokens} tokens each (ignore_eos), "
             "chain speculation. Mean acceptance length counts the bonus/recovered token (vLLM's convention); "
             "acceptance at position j is the fraction of rounds whose first j candidates were all accepted.", "",
             "| K | temperature | mean acceptance length | acceptance per position | rounds |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        per = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lines.append(f"| {r['k']} | {r['temperature']:g} | {r['mean_acceptance_length']:.2f} | {per} | {r['rounds']} |")
    return "\n".join(lines) + "\n"


def update_card(card: Path, section: str) -> None:
    text = card.read_text(encoding="utf-8") if card.exists() else ""
    pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
    text = pattern.sub(section.rstrip() + "\n", text) if SECTION in text else text.rstrip() + "\n\n" + section
    card.write_text(text, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=Path("engine/default_models"))
    ap.add_argument("--ks", default="2,4,6,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", default="target",
                    help="the target's folder under --models, e.g. v4-target (the built-in DeepSeek-V4)")
    ap.add_argument("--update-card", action="store_true", help="rewrite the card's table (the default target only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.models, [int(k) for k in args.ks.split(",")],
                   [float(t) for t in args.temperatures.split(",")], args.num_prompts, args.max_tokens, args.target)
    command = (f"python -m training.measure_acceptance --num-prompts {args.num_prompts} "
               f"--max-tokens {args.max_tokens}")
    section = table(rows, args.num_prompts, args.max_tokens, command)
    print(section)
    if args.update_card and args.target == "target":
        update_card(args.models / "MODEL_CARD.md", section)


if __name__ == "__main__":
    main()
