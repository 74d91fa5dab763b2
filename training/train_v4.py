"""Train the built-in DeepSeek-V4 target: a tiny compressed-state model on the built-in tokenizer and corpus.

    OMP_NUM_THREADS=1 nice python -m training.train_v4 --out engine/default_models/v4-target --minutes 20

What it is for: ``specserve generate --target v4`` with the built-in (Llama) draft, so that speculation runs on
real compressed state (sliding window, CSA with its indexer, HCA) with real, partial acceptance.

How: transformers' ``DeepseekV4ForCausalLM`` with autograd, fp32 on CPU, on 512-token windows of the same
stdlib corpus, tokenized with the *shipped* tokenizer (not a retrained one, so the vocabulary is the built-in
draft's bit for bit). The loss is ``(1 - a) * CE(data) + a * KL(p_teacher || p_v4)`` where the teacher is the
built-in target (``engine/default_models/target``, frozen, no-grad forward on the same batch). The built-in
draft was itself distilled from that teacher, so a V4 that imitates the teacher is one the draft can predict:
that is what gives the draft real acceptance on a target of another architecture after minutes, not hours, of
training. The indexer's top-k is the stable one (ties: lower index first) during training and in the oracle,
the rule our engine uses on every path. Saved as fp16 safetensors with transformers' names (our loader's).

``--quick``: a smoke run (a tiny model, a slice of the corpus, 2 steps; seconds), covered by a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

# One thread: the build machines have 2 cores shared with other work. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from training import data as data_mod  # noqa: E402
from training.models import CONTEXT  # noqa: E402
from training.stable_topk import stable_indexer_topk  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def v4_config(vocab: int, eos_id: int, quick: bool = False) -> Any:
    """The shipped architecture: 4 layers, one of each attention kind plus a second CSA, at context 512.

    Sliding window 32 (a 512-token context is 16 windows), CSA ratio 4 (128 summaries at full context, the
    indexer keeps the top 16 = a quarter), HCA ratio 16 (32 summaries, all visible). MoE: 4 routed experts
    (top 2) + 1 shared, the first layer hash-routed as in V4. Tied embeddings: the 4k-vocabulary embedding is
    the largest single matrix. ~3.8 M parameters, ~7.6 MB in fp16.
    """
    from transformers import DeepseekV4Config

    sizes = dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=4, head_dim=64, q_lora_rank=128,
                 o_lora_rank=64, index_n_heads=2, index_head_dim=32, index_topk=16, sliding_window=32)
    if quick:
        sizes = dict(hidden_size=32, moe_intermediate_size=16, num_attention_heads=2, head_dim=16, q_lora_rank=16,
                     o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8)
    cfg = DeepseekV4Config(
        vocab_size=vocab, num_hidden_layers=4, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, o_groups=2, hc_mult=2, hc_sinkhorn_iters=10, max_position_embeddings=CONTEXT,
        layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, **sizes)
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    return cfg


def new_model(cfg: Any, seed: int) -> Any:
    """A fresh transformers V4 whose hash-routing table gives each token distinct random experts (the stock
    init leaves it all zeros: every token would route to expert 0 twice)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # [vocab, top_k]
                e = cfg.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(e, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]))
    return model


def encode_corpus(tok_path: Path, work: Path, max_files: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) token streams of the stdlib corpus under the *shipped* tokenizer, cached in ``work``."""
    from tokenizers import Tokenizer

    suffix = "" if max_files is None else f"_{max_files}"
    paths = work / f"train{suffix}.npy", work / f"heldout{suffix}.npy"
    if all(p.exists() for p in paths):
        return np.load(paths[0]), np.load(paths[1])
    train, heldout = data_mod.collect_files()
    if max_files is not None:
        train, heldout = train[:max_files], heldout[: max(1, max_files // 10)]
    tok = Tokenizer.from_file(str(tok_path))
    arrays = data_mod.encode_files(tok, train), data_mod.encode_files(tok, heldout)
    work.mkdir(parents=True, exist_ok=True)
    for p, a in zip(paths, arrays, strict=True):
        np.save(p, a)
    return arrays


def save_fp16(model: Any, out_dir: Path, tok_dir: Path) -> None:
    half = copy.deepcopy(model).to(torch.float16)  # the long hash table stays long
    half.config.dtype = torch.float16
    out_dir.mkdir(parents=True, exist_ok=True)
    half.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, out_dir / name)


@torch.no_grad()
def heldout_eval(model: Any, teacher: Any, ids: np.ndarray, n_tokens: int, seq_len: int) -> dict[str, float]:
    """Held-out CE of the V4 and of the teacher, and how often their argmax agree (a greedy-acceptance proxy
    for the built-in draft, which was distilled from the same teacher)."""
    n_win = max(1, min(n_tokens, ids.size - 1) // seq_len)
    rows = np.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n_win)]).astype(np.int64)
    nll = t_nll = agree = 0.0
    count = 0
    model.eval()
    for b in range(0, n_win, 4):
        x = torch.from_numpy(rows[b:b + 4])
        inp, lab = x[:, :-1], x[:, 1:]  # [B, T]
        with stable_indexer_topk():
            lv = model(input_ids=inp, use_cache=False).logits.float()  # [B, T, V]
        lt = teacher(input_ids=inp).logits.float()
        v = lv.size(-1)
        nll += F.cross_entropy(lv.reshape(-1, v), lab.reshape(-1), reduction="sum").item()
        t_nll += F.cross_entropy(lt.reshape(-1, v), lab.reshape(-1), reduction="sum").item()
        agree += (lv.argmax(-1) == lt.argmax(-1)).sum().item()
        count += lab.numel()
    model.train()
    return {"eval_tokens": count, "v4_loss": round(nll / count, 4), "v4_ppl": round(math.exp(nll / count), 2),
            "teacher_loss": round(t_nll / count, 4), "greedy_agree_with_teacher": round(agree / count, 4)}


def train(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    teacher_dir: Path = args.teacher
    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    eos = int(tok.eos_token_id)
    train_ids, heldout_ids = encode_corpus(teacher_dir / "tokenizer.json", args.work,
                                           200 if args.quick else None)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    cfg = v4_config(len(tok), eos, quick=args.quick)
    model = new_model(cfg, args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"V4 target: {n_params / 1e6:.2f} M parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = np.random.default_rng(args.seed)
    warmup = 1 if args.quick else 20
    t0 = time.time()
    history: list[dict[str, float]] = []
    step = 0
    while True:
        # Progress by steps or wall time, whichever ends first: a loaded machine still ends fully decayed.
        progress = max(step / args.steps, (time.time() - t0) / (60.0 * args.minutes))
        if progress >= 1.0:
            break
        f = (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = args.lr * f
        starts = gen.integers(0, train_ids.size - args.seq_len - 1, size=args.batch_size)
        rows = torch.from_numpy(np.stack([train_ids[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))
        inp, lab = rows[:, :-1], rows[:, 1:]  # [B, T]
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(input_ids=inp).logits.float(), dim=-1)  # [B, T, V]
        with stable_indexer_topk():
            logits = model(input_ids=inp, use_cache=False).logits.float()  # [B, T, V]
        v = logits.size(-1)
        ce = F.cross_entropy(logits.reshape(-1, v), lab.reshape(-1))
        kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, v), t_logp.reshape(-1, v), reduction="batchmean",
                      log_target=True)
        loss = (1 - args.kl) * ce + args.kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            rec = {"step": step, "min": round((time.time() - t0) / 60, 2), "lr_f": round(f, 3),
                   "ce": round(ce.item(), 4), "kl": round(kl.item(), 4)}
            history.append(rec)
            print(json.dumps(rec), flush=True)
    minutes = round((time.time() - t0) / 60, 2)
    save_fp16(model, args.out, teacher_dir)
    # Evaluate the shipped fp16 weights (run in fp32), not the fp32 training copy.
    shipped = AutoModelForCausalLM.from_pretrained(str(args.out), dtype=torch.float32)
    ev = heldout_eval(shipped, teacher, heldout_ids, 2048 if args.quick else args.eval_tokens,
                      64 if args.quick else CONTEXT)
    log = {"params": n_params, "steps": step, "minutes": minutes, "tokens_seen": step * args.batch_size * args.seq_len,
           "args": {k: str(v) for k, v in vars(args).items()}, "eval": ev, "history": history}
    print("eval:", json.dumps(ev), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "train_v4_log.json").write_text(json.dumps(log, indent=2))
    return log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("engine/default_models/v4-target"))
    p.add_argument("--teacher", type=Path, default=Path("engine/default_models/target"),
                   help="the built-in target: its tokenizer is used and its outputs are distilled")
    p.add_argument("--work", type=Path, default=Path("runs/v4_work"), help="token cache + log (git-ignored)")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=CONTEXT)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--kl", type=float, default=0.7, help="weight of KL(teacher || V4); 1 - kl on the data CE")
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens (as training.evaluate)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 200 files, 2 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.seq_len, args.log_every = 2, 1, 64, 1
    return args


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
