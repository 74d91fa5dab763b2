"""Training an EAGLE-3 head from the feature cache (training/eagle_cache.py): no target forward per step.

Sequences of different lengths are packed end to end into one batch of about ``tokens`` rows (no padding; each
attends only within itself). The objective is training/eagle.py's — training-time test over ``ttt_steps``
steps, step s feeding each row the head's own output of step s - 1 at the row before — scored against the
target's cached top-k law restricted to the draft vocabulary and renormalised (cross-entropy, i.e. the KL up to
a constant), on the positions that predict an answer token only (the prompts are the user's: never drafted).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.eagle_cache import CachedSeq
from workers.eagle.head import EagleHead


@dataclass
class DistillConfig:
    minutes: float = 40.0  # wall-clock budget; the learning rate's cosine runs on it
    tokens: int = 2048  # rows per optimiser step (packed sequences)
    lr: float = 2e-3
    min_lr_frac: float = 0.05  # the cosine ends at this fraction of lr
    warmup_steps: int = 20
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    text_frac: float = 0.3  # share of sequences drawn from local text (the rest: the target's own answers)
    eval_every_s: float = 300.0  # held-out check and checkpoint this often
    bf16: bool = False  # autocast the head's matmuls (a CPU with fast bf16 only)
    seed: int = 0


class TTTContext:
    """Attention as drafting sees it at every training-time-test step (EAGLE-3's): at step s, row j (drafting
    depth s + 1 from the target-fed row j - s) attends to the step-0 keys of rows <= j - s (the KV the head
    computed from the target's features) and to one key of each later step t <= s, at row j - s + t (the nodes
    drafted before it on its own path, and itself). Each call appends that step's keys and values."""

    def __init__(self, lens: list[int]) -> None:
        self.lens = lens
        self.ks: list[torch.Tensor] = []  # per step [N, Hkv, D]
        self.vs: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.ks.append(k)
        self.vs.append(v)
        s = len(self.ks) - 1
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        if len(set(self.lens)) == 1:  # padded batches (training/eagle_online.py): the same sums, batched
            return self._attend_uniform(q, s)
        outs, start = [], 0
        for n in self.lens:
            sl = slice(start, start + n)
            start += n
            qs = q[sl].transpose(0, 1)  # [Hq, n, D]
            k0 = self.ks[0][sl].transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [Hq, n, D]
            v0 = self.vs[0][sl].transpose(0, 1).repeat_interleave(hq // hkv, 0)
            j = torch.arange(n, device=q.device)
            scores = [(qs @ k0.transpose(1, 2)).masked_fill(j[None, :] > (j[:, None] - s), float("-inf"))]
            vals = []
            for t in range(1, s + 1):  # step t's key at row j - (s - t), [Hq, n, D]
                src = (j - (s - t)).clamp(min=0)
                kt = self.ks[t][sl][src].transpose(0, 1).repeat_interleave(hq // hkv, 0)
                vals.append(self.vs[t][sl][src].transpose(0, 1).repeat_interleave(hq // hkv, 0))
                scores.append((qs * kt).sum(-1, keepdim=True).masked_fill((j < s - t)[None, :, None],
                                                                          float("-inf")))  # [Hq, n, 1]
            p = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(d), dim=-1)  # [Hq, n, n + s]
            o = p[..., :n] @ v0  # [Hq, n, D]
            for t, vt in enumerate(vals):
                o = o + p[..., n + t: n + t + 1] * vt
            outs.append(o.transpose(0, 1))  # [n, Hq, D]
        return torch.cat(outs, dim=0)

    def _attend_uniform(self, q: torch.Tensor, s: int) -> torch.Tensor:
        """``attend`` for B sequences of one length n, as one batched computation (a GPU wants few large calls)."""
        n = self.lens[0]
        b, hq, d = len(self.lens), q.shape[1], q.shape[2]
        hkv = self.ks[0].shape[1]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [B * n, Hkv, D] -> [B, Hq, n, D]
            return x.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)

        qs = q.view(b, n, hq, d).transpose(1, 2)  # [B, Hq, n, D]
        j = torch.arange(n, device=q.device)
        scores = [(qs @ heads(self.ks[0]).transpose(2, 3)).masked_fill(j[None, :] > (j[:, None] - s),
                                                                       float("-inf"))]  # [B, Hq, n, n]
        vals = []
        for t in range(1, s + 1):  # step t's key at row j - (s - t)
            src = (j - (s - t)).clamp(min=0)
            kt = heads(self.ks[t])[:, :, src]  # [B, Hq, n, D]
            vals.append(heads(self.vs[t])[:, :, src])
            scores.append((qs * kt).sum(-1, keepdim=True).masked_fill((j < s - t)[:, None], float("-inf")))
        p = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(d), dim=-1)  # [B, Hq, n, n + s]
        o = p[..., :n] @ heads(self.vs[0])  # [B, Hq, n, D]
        for t, vt in enumerate(vals):
            o = o + p[..., n + t: n + t + 1] * vt
        return o.transpose(1, 2).reshape(b * n, hq, d)


class Batch:
    """Sequences laid end to end: tokens [N], positions [N], the row before each row (-1 at a start), labels,
    weights. ``label`` [N] marks the positions trained on; ``top_ids`` / ``top_logp`` [N, k] the target's law."""

    def __init__(self, lens: list[int], tokens: torch.Tensor, aux: torch.Tensor, top_ids: torch.Tensor,
                 top_logp: torch.Tensor, label: torch.Tensor, local: torch.Tensor) -> None:
        dev = tokens.device
        self.lens, self.tokens, self.aux = lens, tokens, aux.float()  # [N], [N, F]
        self.pos = torch.cat([torch.arange(n, device=dev) for n in lens])  # [N]
        self.prev = torch.arange(len(tokens), device=dev) - 1  # [N]
        self.prev[self.pos == 0] = -1
        rows = local[top_ids]  # [N, k] draft row of each label id, -1 off the draft vocabulary
        lp = top_logp.float().masked_fill(rows < 0, float("-inf"))
        self.p = torch.softmax(lp, dim=-1).nan_to_num(0.0)  # [N, k] the target's law on the draft rows
        self.rows = rows.clamp(min=0)  # [N, k]
        self.top1 = torch.where(rows[:, 0] >= 0, rows[:, 0], -1)  # [N] the target's argmax as a draft row
        self.mask = label & (self.p.sum(-1) > 0)  # [N]

    @classmethod
    def packed(cls, seqs: list[CachedSeq], local: torch.Tensor) -> Batch:
        """Cached sequences packed end to end (no padding; each attends only within itself)."""
        return cls([len(s.ids) for s in seqs], torch.cat([s.ids for s in seqs]), torch.cat([s.aux for s in seqs]),
                   torch.cat([s.top_ids for s in seqs]), torch.cat([s.top_logp for s in seqs]),
                   torch.cat([s.label_mask for s in seqs]), local)

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, H]: each row gets the row before it (zeros at a sequence start)."""
        out = x[self.prev.clamp(min=0)]
        return out.masked_fill((self.prev < 0)[:, None], 0.0)


def descend(opt: torch.optim.Optimizer, head: torch.nn.Module, loss: torch.Tensor) -> None:
    """One optimiser step on ``loss``, gradients clipped to norm 1 (both EAGLE trainers)."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()


def ttt_loss(head: EagleHead, b: Batch, steps: int, decay: float) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over ``steps`` training-time-test steps; each step's top-1 agreement."""
    ctx = TTTContext(b.lens)
    g = b.shift(head.fuse(b.aux))  # [N, H] row j reads the target's feature of position j - 1
    total, weight, agree = g.new_zeros(()), 0.0, []
    for s in range(steps):
        head.features = g
        hidden = head(b.tokens, b.pos, ctx)  # [N, H]
        valid = b.mask & (b.pos > s)  # step s at row j drafts depth s + 1 from row j - s, which needs a feature
        q_log = F.log_softmax(head.lm_head(hidden[valid]).float(), dim=-1)  # [M, Vd]: prompt rows skip lm_head
        ce = -(b.p[valid] * q_log.gather(1, b.rows[valid])).sum(-1).mean()
        total = total + decay ** s * ce
        weight += decay ** s
        agree.append((q_log.argmax(-1) == b.top1[valid]).float().mean().item())
        g = b.shift(head.prenorm)  # the head's own output, one row on: what drafting at depth s + 2 reads
    head.features = head.prenorm = None
    return total / weight, agree


def draft_local(draft_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[V] long: the draft row of each target id, -1 where the head cannot propose it."""
    if draft_ids is None:
        return torch.arange(vocab)
    local = torch.full((vocab,), -1, dtype=torch.long)
    local[draft_ids] = torch.arange(len(draft_ids))
    return local


def sample_batch(rng: random.Random, gen: list[CachedSeq], text: list[CachedSeq], cfg: DistillConfig
                 ) -> list[CachedSeq]:
    out: list[CachedSeq] = []
    n = 0
    while n < cfg.tokens:
        pool = text if text and (not gen or rng.random() < cfg.text_frac) else gen
        s = pool[rng.randrange(len(pool))]
        out.append(s)
        n += len(s.ids)
    return out


@torch.no_grad()
def agreement(head: EagleHead, batches: Iterable[Batch], steps: int) -> list[float]:
    """Teacher-forced top-1 agreement per training-time-test step over ``batches`` (their scored rows)."""
    head.eval()
    res = [0.0] * steps
    n = 0
    for b in batches:
        _, agree = ttt_loss(head, b, steps, 1.0)
        m = int(b.mask.sum())
        res = [r + a * m for r, a in zip(res, agree, strict=True)]
        n += m
    head.train()
    return [round(r / max(n, 1), 4) for r in res]


def heldout_agreement(head: EagleHead, seqs: list[CachedSeq], local: torch.Tensor, steps: int) -> list[float]:
    """``agreement`` on held-out cached sequences (answers only), 16 to a batch."""
    return agreement(head, (Batch.packed(seqs[i: i + 16], local) for i in range(0, len(seqs), 16)), steps)


def distill(head: EagleHead, gen: list[CachedSeq], text: list[CachedSeq], held: list[CachedSeq],
            cfg: DistillConfig, checkpoint=None, log=print) -> dict:
    """Train ``head`` in place for ``cfg.minutes``; ``checkpoint()`` is called at every held-out check."""
    rng = random.Random(cfg.seed)
    local = draft_local(head.draft_ids, head.head_config.vocab_size)
    return optimise(head, lambda: Batch.packed(sample_batch(rng, gen, text, cfg), local),
                    (lambda: heldout_agreement(head, held, local, cfg.ttt_steps)) if held else None,
                    cfg, checkpoint, log)


def optimise(head: EagleHead, next_batch: Callable[[], Batch], heldout: Callable[[], list[float]] | None,
             cfg: DistillConfig, checkpoint=None, log=print) -> dict:
    """The training loop both trainers share: AdamW on ``next_batch()`` for ``cfg.minutes`` of wall clock (warm-up,
    then a cosine on the clock), ``heldout()`` (teacher-forced top-1 per step) and ``checkpoint()`` every
    ``cfg.eval_every_s``."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    start = last_eval = time.perf_counter()
    step, history, agree = 0, [], [0.0]
    loss = torch.zeros(())
    head.train()
    while (elapsed := time.perf_counter() - start) < cfg.minutes * 60:
        frac = elapsed / (cfg.minutes * 60)
        scale = min(1.0, (step + 1) / cfg.warmup_steps) * (
            cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = cfg.lr * scale
        b = next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, agree = ttt_loss(head, b, cfg.ttt_steps, cfg.ttt_decay)
        descend(opt, head, loss)
        step += 1
        if step % 25 == 0 or step == 1:
            log(f"eagle: step {step}, loss {loss.item():.4f}, top-1 per step {[round(a, 3) for a in agree]}, "
                f"lr {cfg.lr * scale:.2e}, {time.perf_counter() - start:.0f} s")
        if heldout is not None and time.perf_counter() - last_eval > cfg.eval_every_s:
            h = heldout()
            history.append({"step": step, "seconds": round(time.perf_counter() - start), "heldout_top1": h})
            log(f"eagle: held-out top-1 per step {h} at step {step}")
            if checkpoint is not None:
                checkpoint()
            last_eval = time.perf_counter()
    head.eval()
    stats = {"steps": step, "train_seconds": round(time.perf_counter() - start, 1),
             "final_loss": round(loss.item(), 4), "train_top1": round(agree[0], 4), "history": history}
    if heldout is not None:
        stats["heldout_top1_per_step"] = heldout()
        stats["heldout_top1"] = stats["heldout_top1_per_step"][0]
    return stats
