"""Widen a trained Llama checkpoint's attention to more heads without changing the function it computes.

The built-in target was trained with 10 query / 5 KV heads, so tensor parallelism can split it only 5 or 10
ways. Retraining costs about three CPU hours; widening is exact and takes seconds:

    python -m training.widen_heads --src engine/default_models/target --out engine/default_models/target \
        --heads 16 --kv-heads 8

Per layer, the new query heads are appended after the old ones and the new KV heads after the old KV heads,
so the GQA grouping of the old heads is kept (query head i still reads KV head i // (heads / kv_heads)).
The new heads' q/k/v rows are zero and so are their o_proj input columns: their attention output is zero
(q = k = 0 gives uniform attention over v = 0, no NaN) and o_proj would discard it anyway. Every other
tensor is copied bit for bit. The widened model therefore computes the same logits up to floating-point
summation order (o_proj now sums over 16 heads' columns instead of 10; the extra terms are exact zeros).

``--check`` reloads both checkpoints with transformers (fp32) and compares logits on held-out text, then runs
both through the specserve engine: greedy outputs on the prompt set, and batch-1 decode time per token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

WEIGHTS = "model.safetensors"
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def widen_state(state: dict[str, torch.Tensor], cfg: dict, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Return a new state dict with ``heads`` query and ``kv_heads`` KV heads per layer (see module doc)."""
    old_heads, old_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // old_heads
    if heads < old_heads or kv_heads < old_kv:
        raise ValueError(f"can only widen: {old_heads}/{old_kv} heads -> {heads}/{kv_heads}")
    if heads % kv_heads or heads // kv_heads != old_heads // old_kv:
        # Appending heads keeps query head i on KV head i // group only if the group size is unchanged.
        raise ValueError(f"query heads per KV head must stay {old_heads // old_kv}; got {heads}/{kv_heads}")
    if any(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for k in state):
        raise ValueError("attention biases are not supported (the built-in models have none)")
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            n_new = heads if ".q_proj." in name else kv_heads
            # [n_old * D, hidden] -> [n_new * D, hidden]: zero rows for the new heads.
            pad = torch.zeros(n_new * head_dim - w.shape[0], w.shape[1], dtype=w.dtype)
            out[name] = torch.cat([w, pad], dim=0).contiguous()
        elif name.endswith("self_attn.o_proj.weight"):
            # [hidden, old_heads * D] -> [hidden, heads * D]: the new heads' outputs get zero weight.
            pad = torch.zeros(w.shape[0], heads * head_dim - w.shape[1], dtype=w.dtype)
            out[name] = torch.cat([w, pad], dim=1).contiguous()
        else:
            out[name] = w
    return out


def widen_checkpoint(src: Path, out: Path, heads: int, kv_heads: int) -> dict[str, object]:
    """Write the widened checkpoint of ``src`` into ``out`` (which may be ``src``: everything is read first)."""
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / WEIGHTS))
    extra = {n: (src / n).read_bytes() for n in COPIED_FILES if (src / n).exists()}
    old = (cfg["num_attention_heads"], cfg.get("num_key_value_heads"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    new_state = widen_state(state, cfg, heads, kv_heads)
    # head_dim written explicitly: hidden_size / num_heads no longer gives it.
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    out.mkdir(parents=True, exist_ok=True)
    # Write to a temporary file first, so a crash never leaves ``out`` with a half-written checkpoint.
    with tempfile.NamedTemporaryFile(dir=out, suffix=".tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    save_file(new_state, str(tmp_path), metadata={"format": "pt"})
    os.replace(tmp_path, out / WEIGHTS)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for n, data in extra.items():
        (out / n).write_bytes(data)
    n_old = sum(t.numel() for t in state.values())
    n_new = sum(t.numel() for t in new_state.values())
    return {"heads": f"{old[0]}/{old[1]} -> {heads}/{kv_heads}", "params_old": n_old, "params_new": n_new,
            "bytes": (out / WEIGHTS).stat().st_size}


def heldout_ids(tokenizer_json: Path, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` of the held-out stream, encoded with the shipped tokenizer."""
    from tokenizers import Tokenizer

    from training import data as data_mod

    ids = data_mod.encode_files(Tokenizer.from_file(str(tokenizer_json)), data_mod.collect_files()[1])
    return torch.from_numpy(ids[:n_tokens].astype("int64"))


@torch.no_grad()
def compare_logits(a_dir: Path, b_dir: Path, ids: torch.Tensor, window: int = 512) -> dict[str, float]:
    """Max |logit difference| and argmax agreement of two checkpoints (transformers, fp32) on ``ids``."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(a_dir), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(b_dir), dtype=torch.float32).eval()
    rows = ids[: ids.numel() // window * window].view(-1, window)  # [windows, window]
    max_diff, agree, count, finite = 0.0, 0, 0, True
    for r in range(0, rows.shape[0], 4):
        la = a(input_ids=rows[r : r + 4]).logits  # [b, window, vocab]
        lb = b(input_ids=rows[r : r + 4]).logits
        finite = finite and bool(torch.isfinite(lb).all())
        max_diff = max(max_diff, (la - lb).abs().max().item())
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
        count += la.shape[0] * la.shape[1]
    return {"tokens": count, "max_abs_logit_diff": max_diff, "argmax_agreement": agree / count,
            "all_finite": finite}


def engine_compare(old_dir: Path, new_dir: Path, prompts: list[str], max_tokens: int,
                   step_tokens: int = 64, repeats: int = 3) -> dict[str, object]:
    """Greedy engine outputs of both targets on ``prompts`` (no speculation, one batch), and the batch-1
    decode time per token of each, alternating old/new ``repeats`` times so machine load hits both alike."""
    import time

    from engine import LLM, SamplingParams

    llms = {"old": LLM(str(old_dir)), "new": LLM(str(new_dir))}
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for _ in prompts]
        outs = {k: [o.token_ids for o in llm.generate(prompts, params)] for k, llm in llms.items()}
        one = SamplingParams(max_tokens=step_tokens, temperature=0.0, ignore_eos=True)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(repeats):
            for k, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompts[:1], [one])
                times[k].append((time.perf_counter() - start) / step_tokens * 1e3)
    finally:
        for llm in llms.values():
            llm.shutdown()
    same = sum(a == b for a, b in zip(outs["old"], outs["new"], strict=True))
    return {"prompts": len(prompts), "max_tokens": max_tokens, "greedy_identical": same,
            "ms_per_token_batch1_old": [round(t, 2) for t in times["old"]],
            "ms_per_token_batch1_new": [round(t, 2) for t in times["new"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=Path("engine/default_models/target"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--check", action="store_true", help="compare old and new logits on held-out text")
    p.add_argument("--check-tokens", type=int, default=16384)
    p.add_argument("--check-prompts", type=Path, default=Path("engine/default_models/prompts.jsonl"),
                   help="--check: prompts whose greedy engine outputs must be identical")
    p.add_argument("--check-max-tokens", type=int, default=64)
    args = p.parse_args()
    backup = None
    if args.check:  # keep the old checkpoint to compare against, even when widening in place
        backup = Path(tempfile.mkdtemp(prefix="widen_src_"))
        shutil.copytree(args.src, backup / "model")
    info = widen_checkpoint(args.src, args.out, args.heads, args.kv_heads)
    print(json.dumps(info), flush=True)
    if backup is not None:
        ids = heldout_ids(args.out / "tokenizer.json", args.check_tokens)
        print(json.dumps(compare_logits(backup / "model", args.out, ids)), flush=True)
        with open(args.check_prompts, encoding="utf-8") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
        print(json.dumps(engine_compare(backup / "model", args.out, prompts, args.check_max_tokens)), flush=True)
        shutil.rmtree(backup)


if __name__ == "__main__":
    main()
