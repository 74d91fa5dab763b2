"""Joint training of the target and an online-distilled draft, in plain PyTorch on CPU.

Both models see the same batches. The target trains on next-token cross-entropy. The draft trains on
    (1 - a) * CE(data) + a * KL(target || draft)
using the target's logits from the target's own training forward pass, so distillation costs no extra
target forward. `a` ramps from 0 to `kl_max` over the first half of training because the early target is
worse than the data; at the end the draft mostly imitates the target, which is what acceptance rewards.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass
class TrainConfig:
    steps: int = 400
    max_minutes: float = 45.0  # the schedule ends at whichever of steps / time comes first
    batch_size: int = 4
    seq_len: int = 512
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    kl_max: float = 0.8
    temperature: float = 1.0
    seed: int = 1234
    log_every: int = 10
    save_every_minutes: float = 10.0  # periodic fp16 snapshots so a usable pair exists early


def lr_factor(progress: float, step: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr_frac, driven by progress in [0, 1]."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_frac + (1.0 - cfg.min_lr_frac) * cos


def make_optimizer(model: torch.nn.Module, lr: float, wd: float) -> torch.optim.AdamW:
    # No weight decay on norms (1-D params); decay on matrices, including the tied embedding.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(data: np.ndarray, gen: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    starts = gen.integers(0, data.size - seq_len - 1, size=batch)
    rows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def save_fp16(model: LlamaForCausalLM, out_dir: Path) -> None:
    # Train in fp32, ship in fp16: halves the files and is what the GPU engine runs anyway.
    half = copy.deepcopy(model).to(torch.float16)
    half.config.dtype = torch.float16
    out_dir.mkdir(parents=True, exist_ok=True)
    half.save_pretrained(str(out_dir), safe_serialization=True)


def train_pair(
    target_cfg: LlamaConfig,
    draft_cfg: LlamaConfig,
    data: np.ndarray,
    cfg: TrainConfig,
    out: dict[str, Path],
    on_snapshot: Callable[[], None] | None = None,
    init: dict[str, Path] | None = None,
) -> dict[str, object]:
    """Train both models; write fp16 snapshots to out['target'] / out['draft']; return a log summary.

    ``init``: start from a previous pair's weights (fp16 on disk, trained on in fp32) instead of random ones.
    """
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM(target_cfg)
    torch.manual_seed(cfg.seed + 1)
    draft = LlamaForCausalLM(draft_cfg)
    if init is not None:
        target = LlamaForCausalLM.from_pretrained(str(init["target"]), dtype=torch.float32)
        draft = LlamaForCausalLM.from_pretrained(str(init["draft"]), dtype=torch.float32)
    target.train()
    draft.train()
    opt_t = make_optimizer(target, cfg.target_lr, cfg.weight_decay)
    opt_d = make_optimizer(draft, cfg.draft_lr, cfg.weight_decay)
    gen = np.random.default_rng(cfg.seed)

    t0 = time.time()
    last_save = t0
    history: list[dict[str, float]] = []
    step = 0
    progress = 0.0
    while progress < 1.0:
        elapsed = time.time() - t0
        progress = max(step / cfg.steps, elapsed / (60.0 * cfg.max_minutes))
        if progress >= 1.0:
            break
        f = lr_factor(progress, step, cfg)
        for g in opt_t.param_groups:
            g["lr"] = cfg.target_lr * f
        for g in opt_d.param_groups:
            g["lr"] = cfg.draft_lr * f
        alpha = cfg.kl_max * min(1.0, 2.0 * progress)

        rows = sample_batch(data, gen, cfg.batch_size, cfg.seq_len)
        inputs, labels = rows[:, :-1], rows[:, 1:]

        t_logits = target(input_ids=inputs).logits
        t_loss = F.cross_entropy(t_logits.reshape(-1, t_logits.size(-1)), labels.reshape(-1))
        opt_t.zero_grad(set_to_none=True)
        t_loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt_t.step()

        soft = F.log_softmax(t_logits.detach() / cfg.temperature, dim=-1)
        del t_logits
        d_logits = draft(input_ids=inputs).logits
        d_ce = F.cross_entropy(d_logits.reshape(-1, d_logits.size(-1)), labels.reshape(-1))
        d_logp = F.log_softmax(d_logits / cfg.temperature, dim=-1)
        # KL(p_target || q_draft), per token; log_target avoids exp/log round-trips.
        kl = F.kl_div(d_logp.reshape(-1, d_logp.size(-1)), soft.reshape(-1, soft.size(-1)),
                      reduction="batchmean", log_target=True)
        d_loss = (1.0 - alpha) * d_ce + alpha * kl * cfg.temperature**2
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()

        step += 1
        if step % cfg.log_every == 0 or step == 1:
            rec = {"step": step, "min": round((time.time() - t0) / 60, 2), "lr_f": round(f, 3),
                   "target_ce": round(t_loss.item(), 4), "draft_ce": round(d_ce.item(), 4),
                   "draft_kl": round(kl.item(), 4), "alpha": round(alpha, 3)}
            history.append(rec)
            print(json.dumps(rec), flush=True)
        if time.time() - last_save > 60.0 * cfg.save_every_minutes:
            save_fp16(target, out["target"])
            save_fp16(draft, out["draft"])
            last_save = time.time()
            print(f"snapshot saved at step {step}", flush=True)
            if on_snapshot:
                on_snapshot()

    save_fp16(target, out["target"])
    save_fp16(draft, out["draft"])
    return {
        "train_config": asdict(cfg),
        "steps_done": step,
        "minutes": round((time.time() - t0) / 60, 2),
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "history": history,
    }
