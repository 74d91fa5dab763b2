"""Held-out evaluation of the shipped (fp16) target/draft pair.

Reports, on the first N tokens of the held-out stream (non-overlapping 512-token windows):
  - per-token cross-entropy and perplexity of both models;
  - greedy agreement: how often argmax(draft) == argmax(target) at the same position, a proxy for
    greedy (temperature 0) acceptance;
  - 1 - TV(p, q) = sum_x min(p(x), q(x)) averaged over positions: the probability that one draft token
    sampled at temperature 1 is accepted by the speculative-sampling rule (Leviathan et al., alpha).
Neither is the engine's measured acceptance length; that comes from training/measure_acceptance.py.

    python -m training.evaluate --models engine/default_models
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WINDOW = 512


def load(model_dir: Path):  # -> (model, tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # fp32 on CPU: fp16 matmuls are slow/unsupported there; the weights themselves are the shipped fp16 ones.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


@torch.no_grad()
def heldout_metrics(target, draft, ids: np.ndarray, n_tokens: int, batch: int = 4) -> dict[str, float]:
    n_windows = max(1, min(n_tokens, ids.size - 1) // WINDOW)
    rows = np.stack([ids[i * WINDOW : i * WINDOW + WINDOW + 1] for i in range(n_windows)]).astype(np.int64)
    sums = {"target_nll": 0.0, "draft_nll": 0.0, "greedy_agree": 0.0, "one_minus_tv": 0.0}
    count = 0
    for b in range(0, n_windows, batch):
        x = torch.from_numpy(rows[b : b + batch])
        inp, lab = x[:, :-1], x[:, 1:]
        lt = target(input_ids=inp).logits.float()
        ld = draft(input_ids=inp).logits.float()
        v = lt.size(-1)
        sums["target_nll"] += F.cross_entropy(lt.reshape(-1, v), lab.reshape(-1), reduction="sum").item()
        sums["draft_nll"] += F.cross_entropy(ld.reshape(-1, v), lab.reshape(-1), reduction="sum").item()
        sums["greedy_agree"] += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        sums["one_minus_tv"] += torch.minimum(lt.softmax(-1), ld.softmax(-1)).sum(-1).sum().item()
        count += lab.numel()
    t_loss, d_loss = sums["target_nll"] / count, sums["draft_nll"] / count
    return {
        "eval_tokens": count,
        "target_loss": round(t_loss, 4),
        "target_ppl": round(float(np.exp(t_loss)), 2),
        "draft_loss": round(d_loss, 4),
        "draft_ppl": round(float(np.exp(d_loss)), 2),
        "greedy_agreement": round(sums["greedy_agree"] / count, 4),
        "sampling_accept_rate_t1": round(sums["one_minus_tv"] / count, 4),
    }


@torch.no_grad()
def greedy_samples(model, tok, prompts: list[dict], n: int = 2, new_tokens: int = 64) -> list[dict[str, str]]:
    """Greedy continuations of the first signature prompt and the first prefix prompt."""
    chosen = [next(p for p in prompts if p["id"].startswith(k)) for k in ("sig-", "prefix-")][:n]
    out = []
    for p in chosen:
        enc = tok(p["prompt"], return_tensors="pt")
        gen = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        out.append({"id": p["id"], "prompt": p["prompt"],
                    "completion": tok.decode(gen[0, enc["input_ids"].size(1) :])})
    return out


def evaluate_pair(target_dir: Path, draft_dir: Path, heldout_ids: np.ndarray, n_tokens: int,
                  prompts_path: Path) -> dict[str, object]:
    torch.set_num_threads(1)
    target, tok = load(target_dir)
    draft, _ = load(draft_dir)
    result: dict[str, object] = {
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        **heldout_metrics(target, draft, heldout_ids, n_tokens),
    }
    print(json.dumps(result, indent=2), flush=True)
    if prompts_path.exists():
        prompts = [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
        samples = greedy_samples(target, tok, prompts)
        for s in samples:
            print(f"=== {s['id']} (target, greedy, 64 new tokens)\n{s['prompt']}<<<COMPLETION>>>"
                  f"{s['completion']}\n", flush=True)
        result["target_samples"] = samples
    (target_dir.parent / "eval_results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("engine/default_models"))
    p.add_argument("--heldout", type=Path, default=Path("runs/default_models_work/heldout.npy"),
                   help="token array written by the data stage of training.train_all")
    p.add_argument("--tokens", type=int, default=65536)
    args = p.parse_args()
    evaluate_pair(args.models / "target", args.models / "draft", np.load(args.heldout), args.tokens,
                  args.models / "prompts.jsonl")


if __name__ == "__main__":
    main()
