"""Second-stage draft distillation on the target's own outputs (sequence-level + token-level KD).

    python -m training.distill gen     --models engine/default_models --minutes 15
    python -m training.distill distill --models engine/default_models --minutes 60

Why: in the engine the draft only ever predicts text the *target* wrote (greedy or sampled continuations of
a prompt), and an undertrained target writes text unlike the corpus (it loops and repeats itself). A draft
trained on the corpus alone agrees with the target far less there than on held-out corpus text. So:

  gen:     prompts from *training* files (the held-out prompt set stays unseen), continuations written by the
           target with the specserve engine, half greedy and half at temperature 0.8 (the two settings the
           model card reports), saved as token arrays.
  distill: the target is frozen; the draft minimises KL(p_target || q_draft) at every position of those
           sequences (the target's soft labels come from a no-grad forward on the same batch), mixed with a
           share of corpus windows so it keeps the general distribution. Acceptance is sum_x min(p, q), which
           this KL bounds from below, and greedy acceptance is argmax agreement on exactly these contexts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GEN_FILE = "target_gen.npz"
MAX_NEW_TOKENS = 128
GEN_TEMPERATURES = (0.0, 0.8)
SEED = 4321  # prompt choice, sampling seeds, batch order and held-out slice of the distillation stages
# The settings the shipped draft was built with; the CLI and training.train_all both default to them.
NUM_PROMPTS, CHUNK = 4096, 128
STEPS, BATCH, CORPUS_EVERY, LR, EVAL_SEQS = 100000, 8, 4, 1.5e-3, 64


def train_prompts(tokenizer_dir: str, n: int, seed: int) -> list[str]:
    """Signature and prefix prompts (same recipe as the held-out set) from the training files only."""
    from transformers import AutoTokenizer

    from training.data import collect_files
    from training.prompts import MAX_PROMPT_TOKENS, _candidates, _pick

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def fits(text: str) -> bool:
        return 8 <= len(tok(text)["input_ids"]) <= MAX_PROMPT_TOKENS

    train_files = sorted(collect_files()[0], key=lambda f: f.rel)
    rng = random.Random(seed)
    sig_lists, prefix_lists = zip(*(_candidates(f) for f in train_files), strict=True)
    picked = _pick(list(sig_lists), n // 2, rng, fits) + _pick(list(prefix_lists), n - n // 2, rng, fits)
    rng.shuffle(picked)
    return [text for _, text in picked]


def save_sequences(path: Path, seqs: list[list[int]], prompt_lens: list[int], temps: list[float]) -> None:
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    np.savez(path, tokens=np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
             offsets=np.concatenate([[0], np.cumsum(lens)]), prompt_lens=np.asarray(prompt_lens, dtype=np.int32),
             temperatures=np.asarray(temps, dtype=np.float32))


def load_sequences(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    z = np.load(path)
    offs = z["offsets"]
    seqs = [z["tokens"][offs[i] : offs[i + 1]].astype(np.int64) for i in range(len(offs) - 1)]
    return seqs, z["prompt_lens"]


def generate(models: Path, work: Path, minutes: float, num_prompts: int = NUM_PROMPTS, chunk: int = CHUNK,
             seed: int = SEED) -> dict[str, object]:
    """Target continuations with the engine (no speculation: only the target's law matters here)."""
    from engine import LLM, SamplingParams

    prompts = train_prompts(str(models / "target"), num_prompts, seed)
    llm = LLM(str(models / "target"), None, max_num_seqs=chunk, max_num_batched_tokens=4096)
    seqs: list[list[int]] = []
    prompt_lens: list[int] = []
    temps: list[float] = []
    t0 = time.time()
    for start in range(0, len(prompts), chunk):
        if time.time() - t0 > 60.0 * minutes:
            break
        batch = prompts[start : start + chunk]
        params = [SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=GEN_TEMPERATURES[(start + i) % 2],
                                 seed=seed + start + i, ignore_eos=True) for i in range(len(batch))]
        for i, out in enumerate(llm.generate(batch, params)):
            seqs.append(out.prompt_token_ids + out.token_ids)
            prompt_lens.append(len(out.prompt_token_ids))
            temps.append(GEN_TEMPERATURES[(start + i) % 2])
        save_sequences(work / GEN_FILE, seqs, prompt_lens, temps)  # every chunk: a cut-off run keeps its data
        new = sum(len(s) - p for s, p in zip(seqs, prompt_lens, strict=True))
        print(json.dumps({"prompts_done": len(seqs), "new_tokens": new, "min": round((time.time() - t0) / 60, 2)}),
              flush=True)
    llm.shutdown()
    return {"sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs)),
            "new_tokens": int(sum(len(s) - p for s, p in zip(seqs, prompt_lens, strict=True))),
            "minutes": round((time.time() - t0) / 60, 2)}


def pad_batch(seqs: list[np.ndarray], prompt_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [B, L], valid [B, L] bool, is_new [B, L] bool): position t predicts token t+1."""
    length = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), length, dtype=torch.long)
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    is_new = torch.zeros(len(seqs), length, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        n = len(s) - 1
        inputs[i, :n] = torch.from_numpy(s[:-1])
        valid[i, :n] = True
        is_new[i, p - 1 : n] = True  # predictions of the target-written tokens
    return inputs, valid, is_new


@torch.no_grad()
def agreement(target: torch.nn.Module, draft: torch.nn.Module, seqs: list[np.ndarray], prompt_lens: list[int],
              batch: int = 16) -> dict[str, float]:
    """On the target-written positions: argmax agreement and mean sum_x min(p, q) (T=1)."""
    agree = overlap = count = 0.0
    for i in range(0, len(seqs), batch):
        inputs, _, is_new = pad_batch(seqs[i : i + batch], prompt_lens[i : i + batch])
        p = torch.softmax(target(input_ids=inputs).logits.float(), -1)[is_new]  # [N, V]
        q = torch.softmax(draft(input_ids=inputs).logits.float(), -1)[is_new]  # [N, V]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum().item()
        count += p.size(0)
    return {"greedy_agreement": round(agree / count, 4), "sum_min_pq": round(overlap / count, 4)}


def distill(models: Path, work: Path, out: Path, minutes: float, steps: int = STEPS, batch: int = BATCH,
            corpus_every: int = CORPUS_EVERY, lr: float = LR, seed: int = SEED,
            eval_seqs: int = EVAL_SEQS) -> dict[str, object]:
    from transformers import LlamaForCausalLM

    from training.train import make_optimizer, sample_batch, save_fp16

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    seqs, plens = load_sequences(work / GEN_FILE)
    plens = [int(p) for p in plens]
    # The last eval_seqs sequences are held out for the agreement numbers printed while training.
    ev_seqs, ev_plens = seqs[-eval_seqs:], plens[-eval_seqs:]
    tr_seqs, tr_plens = seqs[:-eval_seqs], plens[:-eval_seqs]
    corpus = np.load(work / "train.npy")
    target = LlamaForCausalLM.from_pretrained(str(models / "target"), dtype=torch.float32).eval()
    for prm in target.parameters():
        prm.requires_grad_(False)
    draft = LlamaForCausalLM.from_pretrained(str(models / "draft"), dtype=torch.float32)
    opt = make_optimizer(draft, lr, 0.1)
    draft.eval()
    history: list[dict[str, object]] = [{"step": 0, **agreement(target, draft, ev_seqs, ev_plens)}]
    print(json.dumps(history[-1]), flush=True)
    draft.train()
    t0 = time.time()
    step = 0
    warmup = 20
    while True:
        progress = max(step / steps, (time.time() - t0) / (60.0 * minutes))
        if progress >= 1.0:
            break
        f = (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr * f
        if corpus_every and step % corpus_every == corpus_every - 1:
            rows = sample_batch(corpus, rng, batch, 256)
            inputs = rows[:, :-1]
            valid = torch.ones_like(inputs, dtype=torch.bool)
        else:
            idx = rng.integers(0, len(tr_seqs), size=batch)
            inputs, valid, _ = pad_batch([tr_seqs[i] for i in idx], [tr_plens[i] for i in idx])
        with torch.no_grad():
            soft = F.log_softmax(target(input_ids=inputs).logits[valid], -1)  # [N, V]
        d_logp = F.log_softmax(draft(input_ids=inputs).logits[valid], -1)  # [N, V]
        loss = F.kl_div(d_logp, soft, reduction="batchmean", log_target=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            rec: dict[str, object] = {"step": step, "min": round((time.time() - t0) / 60, 2),
                                      "lr_f": round(f, 3), "kl": round(loss.item(), 4)}
            if step % 200 == 0:
                draft.eval()
                rec.update(agreement(target, draft, ev_seqs, ev_plens))
                draft.train()
                save_fp16(draft, out / "draft")
            history.append(rec)
            print(json.dumps(rec), flush=True)
    draft.eval()
    history.append({"step": step, **agreement(target, draft, ev_seqs, ev_plens)})
    print(json.dumps(history[-1]), flush=True)
    save_fp16(draft, out / "draft")
    return {"steps": step, "minutes": round((time.time() - t0) / 60, 2), "batch": batch,
            "corpus_every": corpus_every, "lr": lr, "train_sequences": len(tr_seqs), "history": history}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("gen", "distill"))
    ap.add_argument("--models", type=Path, default=Path("engine/default_models"), help="dir with target/, draft/")
    ap.add_argument("--out", type=Path, default=None, help="where the distilled draft/ goes (default: --models)")
    ap.add_argument("--work", type=Path, default=Path("runs/default_models_work"))
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--chunk", type=int, default=CHUNK, help="gen: prompts per engine call")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--corpus-every", type=int, default=CORPUS_EVERY,
                    help="every Nth step is a corpus batch (0: never)")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--eval-seqs", type=int, default=EVAL_SEQS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.work / "distill_log.json"
    log: dict[str, object] = json.loads(log_path.read_text()) if log_path.exists() else {}
    if args.stage == "gen":
        log["gen"] = generate(args.models, args.work, args.minutes, args.num_prompts, args.chunk, args.seed)
    else:
        log["distill"] = distill(args.models, args.work, args.out or args.models, args.minutes, args.steps,
                                 args.batch_size, args.corpus_every, args.lr, args.seed, args.eval_seqs)
    log_path.write_text(json.dumps(log, indent=2))
    print(json.dumps({k: v for k, v in log[args.stage].items() if k != "history"}), flush=True)


if __name__ == "__main__":
    main()
