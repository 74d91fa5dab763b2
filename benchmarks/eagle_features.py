"""What the EAGLE head's features cost per step: bytes handed from the verify pass to the head, and the time of
gathering them, beside the step's verify and draft time (docs/architecture.md, "EAGLE heads").

    OMP_NUM_THREADS=1 python -m benchmarks.eagle_features [--target T --head DIR] [--batches 1,8] [--k 4]

Default: the built-in target and its shipped head; ``--random-head``: a random head for ``--target`` (its cost,
not its acceptance). The gathering is timed by wrapping the target worker's
``_features`` in this process (a probe, not a product path).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    from engine.core.config import DEFAULT_MODELS_DIR, default_model_dirs
    from engine.drafting.eagle import shipped_head
    from engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m benchmarks.eagle_features")
    ap.add_argument("--target", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--random-head", default=None, metavar="DIR", help="write a random head (trimmed to 4096 ids) here")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from workers.gguf_loader import resolve_model_path

    target = resolve_model_path(a.target) if a.target else default_model_dirs()[0]
    head = a.head or (None if a.random_head else shipped_head("builtin"))
    if a.random_head:
        from training.eagle_layout import random_head
        from workers.model_config import ModelConfig

        tcfg = ModelConfig.from_pretrained(target)
        head = random_head(a.random_head, tcfg, draft_ids=list(range(min(4096, tcfg.vocab_size))))
    with open(DEFAULT_MODELS_DIR / "prompts.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    for batch in [int(b) for b in a.batches.split(",")]:
        llm = LLM(target, {"method": "eagle3", "model": head, "num_speculative_tokens": a.k, "adaptive": False})
        worker = llm.engine.executor.target
        spent, sent, steps = 0.0, 0, 0
        real = worker._features

        def timed(msg, results, real=real):  # noqa: ANN001 - the worker's own signature
            nonlocal spent, sent, steps
            start = time.perf_counter()
            out = real(msg, results)
            spent += time.perf_counter() - start
            sent += sum(f.rows.numel() * f.rows.element_size() for f in out)
            steps += 1
            return out

        worker._features = timed
        llm.generate(prompts[:batch], SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))
        times, stats = llm.engine.times, llm.engine.stats
        print(json.dumps({"batch": batch, "steps": steps, "bytes_per_step": round(sent / steps),
                          "gather_ms_per_step": round(1e3 * spent / steps, 3),
                          "verify_ms_per_step": round(1e3 * times.verify_s / steps, 2),
                          "draft_ms_per_step": round(1e3 * times.draft_s / steps, 2),
                          "mean_acceptance_length": round(stats.mean_acceptance_length, 3)}))
        llm.shutdown()


if __name__ == "__main__":
    main()
