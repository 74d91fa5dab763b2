"""One command that rebuilds the built-in default models: tokenizer, target + draft, the target widened to
16 / 8 heads (exact), prompts, draft distillation on the target's own outputs, evaluation.

    OMP_NUM_THREADS=1 python -m training.train_all --out engine/default_models

`--quick` runs every stage with a handful of steps (a smoke test, about a minute); its weights are useless.
`--stages` reruns a subset (e.g. `--stages prompts,eval` after a finished training run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

# One thread: the build machines have 2 cores shared with other work. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library's thread pool

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training import data as data_mod  # noqa: E402
from training.models import CONTEXT, draft_config, target_config  # noqa: E402
from training.train import TrainConfig, train_pair  # noqa: E402

STAGES = ("data", "train", "widen", "prompts", "gen", "distill", "eval")
# The target trains with 10 query / 5 KV heads (training/models.py); the widen stage pads it exactly to 16 / 8
# (training/widen_heads.py) so that tensor parallelism can split it 2, 4 or 8 ways. Idempotent.
WIDE_HEADS, WIDE_KV_HEADS = 16, 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(tok_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, dest / name)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("engine/default_models"))
    p.add_argument("--work", type=Path, default=Path("runs/default_models_work"),
                   help="scratch dir for the token arrays and the training log (git-ignored)")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--max-minutes", type=float, default=TrainConfig.max_minutes)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue from a previous pair (a dir with target/ and draft/), with a fresh schedule")
    p.add_argument("--gen-minutes", type=float, default=18.0,
                   help="gen stage: time for the target to write continuations of training-file prompts")
    p.add_argument("--distill-minutes", type=float, default=70.0, help="distill stage: draft-only training time")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens used for loss/agreement")
    p.add_argument("--quick", action="store_true", help="smoke run: a few steps, tiny eval")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    work: Path = args.work
    out: Path = args.out
    dirs = {"target": out / "target", "draft": out / "draft"}
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "train_all_log.json"
    log: dict[str, object] = json.loads(log_path.read_text()) if log_path.exists() else {}

    if "data" in stages:
        t0 = time.time()
        log["data"] = data_mod.build_data(work, args.vocab_size, CONTEXT)
        log["data_minutes"] = round((time.time() - t0) / 60, 2)
        print("data:", json.dumps(log["data"]), flush=True)
        for d in dirs.values():
            copy_tokenizer(work / "tokenizer", d)

    if "train" in stages:
        cfg = TrainConfig(steps=args.steps, max_minutes=args.max_minutes, batch_size=args.batch_size,
                          seq_len=args.seq_len, seed=args.seed)
        if args.quick:
            cfg = TrainConfig(steps=3, max_minutes=2.0, batch_size=1, seq_len=128, warmup_steps=1,
                              log_every=1, seed=args.seed)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
        eos = int(tok.eos_token_id)
        train_ids = np.load(work / "train.npy")
        t_cfg, d_cfg = target_config(len(tok), eos), draft_config(len(tok), eos)
        init = None
        if args.init_from is not None:
            # Copy first: the snapshots below overwrite the output dirs, which may be the init dirs themselves.
            init = {k: work / f"init_{k}" for k in dirs}
            for k, d in init.items():
                shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(args.init_from / k, d)
        log["train"] = train_pair(t_cfg, d_cfg, train_ids, cfg, dirs, init=init)
        for d in dirs.values():
            copy_tokenizer(work / "tokenizer", d)
        log_path.write_text(json.dumps(log, indent=2))

    if "widen" in stages:
        from training.widen_heads import widen_checkpoint

        log["widen"] = widen_checkpoint(dirs["target"], dirs["target"], WIDE_HEADS, WIDE_KV_HEADS)
        print("widen:", json.dumps(log["widen"]), flush=True)
        log_path.write_text(json.dumps(log, indent=2))

    if "prompts" in stages:
        from training.prompts import build_prompts  # imported late: only needed for this stage

        heldout = [f for f in data_mod.collect_files()[1]]
        log["prompts"] = build_prompts(heldout, out / "prompts.jsonl", str(dirs["target"]), seed=args.seed)

    if "gen" in stages or "distill" in stages:
        from training import distill as distill_mod

        if "gen" in stages:
            log["gen"] = (distill_mod.generate(out, work, 1.0, num_prompts=8, chunk=4) if args.quick
                          else distill_mod.generate(out, work, args.gen_minutes))
        if "distill" in stages:
            log["distill"] = (distill_mod.distill(out, work, out, 1.0, steps=3, batch=2, eval_seqs=2) if args.quick
                              else distill_mod.distill(out, work, out, args.distill_minutes))
        log_path.write_text(json.dumps(log, indent=2))

    if "eval" in stages:
        from training.evaluate import evaluate_pair

        n = 4096 if args.quick else args.eval_tokens
        log["eval"] = evaluate_pair(dirs["target"], dirs["draft"], np.load(work / "heldout.npy"), n,
                                    out / "prompts.jsonl")
    log_path.write_text(json.dumps(log, indent=2))
    print(f"done; log in {log_path}", flush=True)


if __name__ == "__main__":
    main()
