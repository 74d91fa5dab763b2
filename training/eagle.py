"""python -m training.eagle: train an EAGLE-3 head for a target, on CPU, and write it in the published layout.

    # the built-in target (a few minutes on one core; what engine/default_models/target-eagle3 was made with)
    OMP_NUM_THREADS=1 python -m training.eagle --target builtin --out engine/default_models/target-eagle3 --minutes 12
    # SmolLM2, after `python -m training.smollm2_draft gen --work runs/smollm2_draft` wrote the target's answers
    # (WORK/gen.jsonl) and held-out prompts: the target's features and laws are cached once (--cache; local text
    # read as that stage reads it), then the head trains from the cache (what smollm2-eagle3 was made with)
    OMP_NUM_THREADS=1 python -m training.eagle --target smollm2 --work runs/smollm2_draft --cache WORK/cache \\
        --docs 2000 --max-text 800 --out engine/default_models/smollm2-eagle3 --draft-vocab 4096 --save-dtype float16 \\
        --minutes 48 --batch 8 --seq-len 256 --bf16 --lr 2e-3
    python -m training.eagle --quick --out /tmp/eagle-quick        # seconds: a smoke run, the weights are useless

Data: sequences of the target's own answers (greedy and T = 0.8; its own continuations of corpus prefixes for the
built-in target, ``training.smollm2_draft gen`` for SmolLM2) and local text (the stdlib corpus of training/data.py
for the built-in target). Features come from the target as it runs (the three layers the head's config names),
labels are the target's own next-token distributions (KL, restricted and renormalised to the draft vocabulary).

Objective, with EAGLE-3's training-time test: step 0 feeds row j the token x_j and the target's feature at j - 1;
step s feeds it the head's own output of step s - 1 at j - 1, as drafting at depth s + 1 does; every step is scored
against the target's distribution at j, weighted ``ttt_decay ** s``. Simplification (ours): at step s every row
attends to the step-s rows before it, where drafting attends to target-fed rows further back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from training.eagle_distill import DistillConfig, descend
from training.eagle_layout import head_config_dict, save_head
from workers.attention import DenseCausalContext
from workers.eagle.head import EagleHead
from workers.eagle.head_config import EagleHeadConfig
from workers.loader import load_model
from workers.model_config import ModelConfig


@dataclass
class EagleTrainConfig:
    minutes: float = 12.0  # wall-clock budget for the optimisation
    steps: int = 4000  # at most this many optimiser steps
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3  # a one-layer head on fixed features tolerates a high rate
    ttt_steps: int = 3  # training-time test depth: more fits deeper drafting, costs a forward each
    ttt_decay: float = 0.8  # EAGLE-3's weight of step s (later steps matter less: they are reached less)
    draft_vocab: int | None = None  # trimmed lm_head rows (most frequent target tokens); None: the whole vocabulary
    seed: int = 0


def target_pass(target: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens -> (aux features [B, T, F], target logits [B, T, V]) from one causal forward."""
    b, t = tokens.shape
    pos = torch.arange(t).repeat(b)
    with torch.no_grad():
        hidden = target(tokens.reshape(-1), pos, DenseCausalContext([t] * b))  # [B * T, H]
        logits = target.compute_logits(hidden).float()
    return target.model.aux_hidden.reshape(b, t, -1).float(), logits.reshape(b, t, -1)


def ttt_loss(head: EagleHead, tokens: torch.Tensor, aux: torch.Tensor, target_logits: torch.Tensor,
             draft_ids: torch.Tensor | None, steps: int, decay: float) -> tuple[torch.Tensor, float]:
    """The weighted KL(target || head) over ``steps`` training-time-test steps; also step 0's top-1 agreement."""
    b, t = tokens.shape
    tl = target_logits if draft_ids is None else target_logits[..., draft_ids]  # [B, T, Vd]
    p_log = F.log_softmax(tl, dim=-1)
    pos = torch.arange(t).repeat(b)
    ctx = DenseCausalContext([t] * b)
    feats = head.fuse(aux)  # [B, T, H]
    zero = feats.new_zeros(b, 1, feats.shape[-1])
    g = torch.cat([zero, feats[:, :-1]], dim=1)  # row j reads the feature of position j - 1
    total, weight, agree = feats.new_zeros(()), 0.0, 0.0
    for s in range(steps):
        head.features = g.reshape(b * t, -1)
        q_log = F.log_softmax(head.lm_head(head(tokens.reshape(-1), pos, ctx)).float(), dim=-1).view(b, t, -1)
        valid = slice(s + 1, t)  # rows that have s real steps of history behind them (row 0 has no feature)
        kl = (p_log.exp() * (p_log - q_log))[:, valid].sum(-1).mean()
        total = total + decay ** s * kl
        weight += decay ** s
        if s == 0:
            agree = (q_log[:, valid].argmax(-1) == p_log[:, valid].argmax(-1)).float().mean().item()
        g = torch.cat([zero, head.prenorm.view(b, t, -1)[:, :-1]], dim=1)  # the head's own output, one row on
    head.features = head.prenorm = None
    return total / weight, agree


def init_head(target_path: str, tcfg: ModelConfig, target: torch.nn.Module, draft_ids: list[int] | None,
              seed: int) -> tuple[EagleHead, dict]:
    """A fresh head: random layer, the target's embedding (frozen) and output rows (trained)."""
    config = head_config_dict(tcfg, draft_vocab_size=len(draft_ids) if draft_ids else None)
    torch.manual_seed(seed)
    head = EagleHead(EagleHeadConfig.from_dict(config))
    with torch.no_grad():
        emb = target.model.embed_tokens.weight.float()
        head.embed_tokens.weight.copy_(emb)
        out = target.lm_head.weight.float()
        head.lm_head.weight.copy_(out if draft_ids is None else out[torch.tensor(draft_ids)])
        if draft_ids is not None:
            head.draft_ids = torch.tensor(draft_ids)
    return _frozen_embedding(head), config


def _frozen_embedding(head: EagleHead) -> EagleHead:
    """Every parameter trained but the (target's) embedding."""
    for name, p in head.named_parameters():
        p.requires_grad_(not name.startswith("embed_tokens."))
    return head


def continued_head(path: str, target_path: str, tcfg: ModelConfig) -> tuple[EagleHead, dict]:
    """A trained head to train on (float32; the embedding frozen, as ``init_head`` leaves it) and its config."""
    from workers.eagle.head import load_head

    head = load_head(path, target_path, tcfg).train()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return _frozen_embedding(head), config


def choose_draft_vocab(seqs: list[list[int]], size: int, vocab: int) -> list[int]:
    """The ``size`` most frequent tokens of the data (ties: lower id), ascending."""
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab)
    return sorted(counts.topk(min(size, vocab)).indices.tolist())


def train_head(target_path: str, seqs: list[list[int]], out: str, cfg: EagleTrainConfig,
               heldout: list[list[int]] | None = None, log=print, save_dtype: torch.dtype = torch.float32) -> dict:
    """Train a head on ``seqs`` (token id lists) and write it to ``out``; returns the run's numbers."""
    torch.manual_seed(cfg.seed)
    tcfg = ModelConfig.from_pretrained(target_path)
    target = load_model(target_path, dtype=torch.float32)
    draft_ids = choose_draft_vocab(seqs, cfg.draft_vocab, tcfg.vocab_size) if cfg.draft_vocab else None
    head, config = init_head(target_path, tcfg, target, draft_ids, cfg.seed)
    target.model.aux_layers = EagleHeadConfig.from_dict(config).aux_layers(tcfg.num_layers)
    ids = torch.tensor(draft_ids) if draft_ids else None
    windows = [s[i: i + cfg.seq_len] for s in seqs for i in range(0, max(1, len(s) - cfg.seq_len // 2), cfg.seq_len)
               if len(s[i: i + cfg.seq_len]) == cfg.seq_len]
    if not windows:
        raise ValueError(f"no sequence has {cfg.seq_len} tokens: lower --seq-len")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    start, step, agree = time.perf_counter(), 0, 0.0
    while step < cfg.steps and time.perf_counter() - start < cfg.minutes * 60:
        batch = torch.tensor(rng.sample(windows, min(cfg.batch, len(windows))))  # [B, T]
        aux, logits = target_pass(target, batch)
        for g in opt.param_groups:  # cosine to 10 %, on the step budget
            g["lr"] = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / cfg.steps))))
        loss, agree = ttt_loss(head, batch, aux, logits, ids, cfg.ttt_steps, cfg.ttt_decay)
        descend(opt, head, loss)
        step += 1
        if step % 50 == 0 or step == 1:
            log(f"eagle: step {step}, loss {loss.item():.4f}, top-1 agreement {agree:.3f}, "
                f"{time.perf_counter() - start:.0f} s")
    head.eval()
    stats = {"steps": step, "train_seconds": round(time.perf_counter() - start, 1), "windows": len(windows),
             "final_loss": round(loss.item(), 4), "train_top1": round(agree, 4), "config": asdict(cfg)}
    if heldout:
        with torch.no_grad():
            hb = torch.tensor([s[: cfg.seq_len] for s in heldout if len(s) >= cfg.seq_len][:32])
            if len(hb):
                aux, logits = target_pass(target, hb)
                _, stats["heldout_top1"] = ttt_loss(head, hb, aux, logits, ids, 1, 1.0)
    save_head(out, config, head, ids, save_dtype)
    with open(os.path.join(out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def train_cached(target_path: str, cache: Path, out: str, cfg: DistillConfig, draft_vocab: int | None,
                 save_dtype: torch.dtype = torch.float32, log=print, init: str | None = None) -> dict:
    """Train a head from the feature cache (training/eagle_cache.py) and write it to ``out``; every 25th cached
    answer (by instruction number) is held out for the teacher-forced agreement the run reports. ``init``: a head
    directory to continue from (its weights and its draft vocabulary; ``draft_vocab`` is then ignored)."""
    from training.eagle_cache import cache_meta, read_cache
    from training.eagle_distill import distill

    data = read_cache(cache, ["gen", "text"])
    held = [s for s in data["gen"] if s.index % 25 == 0]
    gen = [s for s in data["gen"] if s.index % 25 != 0]
    if not gen and not data["text"]:
        raise ValueError(f"{cache} holds no cached sequences: build it first (--cache with --work)")
    tcfg = ModelConfig.from_pretrained(target_path)
    target = load_model(target_path, dtype=torch.float32, quantization="none")
    if init:
        head, config = continued_head(init, target_path, tcfg)
        draft_ids = None if head.draft_ids is None else head.draft_ids.tolist()
    else:
        answers = ([s.ids[s.answer_start:] for s in gen] +
                   [s.ids[s.answer_start:] for s in data["text"][: len(gen) // 5]])
        draft_ids = (sorted(torch.bincount(torch.cat(answers), minlength=tcfg.vocab_size)
                            .topk(min(draft_vocab, tcfg.vocab_size)).indices.tolist()) if draft_vocab else None)
        head, config = init_head(target_path, tcfg, target, draft_ids, cfg.seed)
    del target
    aux = EagleHeadConfig.from_dict(config).aux_layers(tcfg.num_layers)
    if tuple(cache_meta(cache)["aux_layers"]) != tuple(aux):
        raise ValueError(f"{cache} holds layers {cache_meta(cache)['aux_layers']}, the head reads {list(aux)}")
    ids = torch.tensor(draft_ids) if draft_ids else None
    log(f"eagle: {len(gen)} answers ({sum(len(s.ids) for s in gen)} positions), {len(data['text'])} text "
        f"sequences ({sum(len(s.ids) for s in data['text'])}), {len(held)} held out")
    stats = distill(head, gen, data["text"], held, cfg, lambda: save_head(out, config, head, ids, save_dtype),
                    log=log)
    stats.update(answers=len(gen), text_sequences=len(data["text"]), heldout_sequences=len(held),
                 positions=sum(len(s.ids) for s in gen + data["text"]), config=asdict(cfg))
    save_head(out, config, head, ids, save_dtype)
    with open(os.path.join(out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def build_chat_cache(target: str, work: str, cache: Path, docs: int, max_text: int | None, minutes: float,
                     seq_len: int) -> None:
    """Cache the features and laws of the target's answers (WORK/gen.jsonl) and of ``docs`` local documents."""
    from training.eagle_cache import build_cache
    from training.smollm2_draft import _read_gen, _text_rows
    from workers.loader import load_tokenizer

    aux = EagleHeadConfig.from_dict(head_config_dict(ModelConfig.from_pretrained(target))).aux_layers(
        ModelConfig.from_pretrained(target).num_layers)
    rows = [{"index": i, **r} for i, r in enumerate(_read_gen(Path(work)))]  # gen writes "index"; others may not
    print(json.dumps(build_cache(target, rows, cache, "gen", aux, minutes=minutes)), flush=True)
    if docs > 0:
        rows = _text_rows(load_tokenizer(target), docs, seq_len, None, Path(work))[:max_text]
        print(json.dumps(build_cache(target, rows, cache, "text", aux, minutes=minutes)), flush=True)


def builtin_sequences(target_path: str, n_windows: int, seq_len: int, n_gen: int, gen_tokens: int,
                      seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Stdlib corpus windows (training/data.py's split) and the target's own continuations of train-split
    prefixes (half greedy, half T = 0.8), and held-out windows."""
    from tokenizers import Tokenizer

    from engine import LLM, SamplingParams
    from training.data import collect_files, encode_files

    tok = Tokenizer.from_file(os.path.join(target_path, "tokenizer.json"))
    train, heldout = collect_files()
    rng = random.Random(seed)
    stream = encode_files(tok, rng.sample(train, min(len(train), 200))).tolist()
    starts = [rng.randrange(0, len(stream) - seq_len) for _ in range(n_windows + n_gen)]
    text = [stream[s: s + seq_len] for s in starts[:n_windows]]
    prompts = [stream[s: s + 32] for s in starts[n_windows:]]
    llm = LLM(target_path, "none", max_num_seqs=16)
    params = [SamplingParams(max_tokens=gen_tokens, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    answers = [p + list(o.token_ids) for p, o in zip(prompts, llm.generate(prompts, params), strict=True)]
    llm.shutdown()
    held = encode_files(tok, heldout[:20]).tolist()
    return text + answers, [held[i: i + seq_len] for i in range(0, len(held) - seq_len, seq_len * 7)][:32]


def chat_sequences(target: str, work: str, docs: int, seq_len: int) -> list[list[int]]:
    """The SmolLM2 draft stages' data (training/smollm2_draft.py): the target's own answers (``WORK/gen.jsonl`` of
    its ``gen`` stage) and, with ``docs`` > 0, local documents as chat turns; prompt + answer per sequence."""
    with open(os.path.join(work, "gen.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if docs > 0:
        from training.smollm2_draft import _text_rows
        from workers.loader import load_tokenizer

        rows += _text_rows(load_tokenizer(target), docs, seq_len, None, Path(work))
    return [r["prompt_ids"] + r["answer_ids"] for r in rows]


def heldout_acceptance(target: str, head: str, prompts: list, k: int = 4, max_tokens: int = 64,
                       nodes: int = 8) -> dict:
    """Mean acceptance length (bonus included) of the head at a fixed K, greedy, on held-out prompts: a chain,
    and a dynamic tree of ``nodes`` nodes; with the engine, as a user runs it."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for name, extra in (("chain", {}), (f"tree{nodes}", {"num_draft_tokens": nodes})):
        llm = LLM(target, {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive": False,
                           **extra}, max_num_seqs=8)
        llm.generate(prompts, params)
        out[f"mean_acceptance_length_k{k}_{name}"] = round(llm.engine.stats.mean_acceptance_length, 3)
        llm.shutdown()
    return out


CARD = """# EAGLE-3 head for {target_name}

A one-layer EAGLE-3 head (published layout: vLLM / SGLang load it as is) for `{target}`. Use it with
`--speculative-config '{{"method": "eagle3", "num_speculative_tokens": 4}}'` (the shipped head is the default
of `"method": "eagle3"` on this target) or `"model": "<this directory>"`.

- **Features**: the target's hidden states at the input of layers {aux} (fused by `fc`), plus the token's embedding
  (the target's, not stored here).
- **Data**: {data}
- **Objective**: KL(target || head) over {ttt} training-time-test steps (weights 0.8^s), training/eagle.py.
- **Command**: `{command}`
- **Run**: {steps} steps in {seconds} s on a shared 2-core CPU (1 thread); final loss {loss}, train top-1 agreement
  {top1}, held-out top-1 agreement {heldout_top1}.
- **Held-out acceptance** (engine, greedy, K = 4, mean acceptance length incl. the bonus token): {acceptance}.
{notes}"""


def write_card(out: str, target_name: str, target: str, stats: dict, acceptance: dict, data: str,
               command: str) -> None:
    with open(os.path.join(out, "config.json")) as f:
        aux = json.load(f).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    text = CARD.format(target_name=target_name, target=target, aux=aux, data=data, ttt=stats["config"]["ttt_steps"],
                       command=command, steps=stats["steps"], seconds=stats["train_seconds"],
                       loss=stats["final_loss"], top1=stats["train_top1"],
                       heldout_top1=round(stats.get("heldout_top1", float("nan")), 3),
                       acceptance=", ".join(f"{k} {v}" for k, v in acceptance.items()) or "not measured",
                       notes="" if "heldout_top1_per_step" not in stats else (
                           f"- **From the cache** (training/eagle_distill.py): loss on answer positions only, "
                           f"labels the target's top-32 laws; held-out teacher-forced top-1 per training-time-test "
                           f"step {stats['heldout_top1_per_step']} ({stats['heldout_sequences']} held-out answers), "
                           f"history {[(h['step'], h['heldout_top1'][0]) for h in stats['history']]}.\n"))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m training.eagle", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="builtin", help="builtin, smollm2, or a checkpoint directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="runs/eagle_work", help="smollm2: where training.smollm2_draft gen wrote")
    ap.add_argument("--minutes", type=float, default=EagleTrainConfig.minutes)
    ap.add_argument("--steps", type=int, default=EagleTrainConfig.steps)
    ap.add_argument("--seq-len", type=int, default=EagleTrainConfig.seq_len)
    ap.add_argument("--batch", type=int, default=EagleTrainConfig.batch)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--windows", type=int, default=600, help="builtin: corpus windows")
    ap.add_argument("--gen", type=int, default=96, help="builtin: continuations the target writes")
    ap.add_argument("--docs", type=int, default=0, help="chat targets: local documents read as answers")
    ap.add_argument("--save-dtype", default="float32", help="stored weights (float16 halves a SmolLM2 head)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of seconds (useless weights)")
    ap.add_argument("--cache", default=None, help="chat targets: train from the features and laws cached here "
                    "(built or extended first from WORK/gen.jsonl and --docs; training/eagle_cache.py)")
    ap.add_argument("--cache-only", action="store_true", help="build / extend --cache, then stop")
    ap.add_argument("--cache-minutes", type=float, default=60.0, help="time bound of each source's caching")
    ap.add_argument("--max-text", type=int, default=None, help="--cache: at most this many local documents")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--text-frac", type=float, default=DistillConfig.text_frac, help="--cache: local-text share")
    ap.add_argument("--bf16", action="store_true", help="--cache: bf16 autocast for the head's matmuls")
    ap.add_argument("--init", default=None, help="--cache: continue from this head directory (its draft vocabulary)")
    a = ap.parse_args(argv)
    cfg = EagleTrainConfig(minutes=a.minutes, steps=a.steps, batch=a.batch, seq_len=a.seq_len,
                           draft_vocab=a.draft_vocab)
    if a.quick:
        cfg = EagleTrainConfig(minutes=1.0, steps=3, batch=2, seq_len=32, draft_vocab=a.draft_vocab)
    if a.target == "builtin":
        from engine.core.config import default_model_dirs

        target = default_model_dirs()[0]
        n = (8, 4, 16) if a.quick else (a.windows, a.gen, 128)
        seqs, held = builtin_sequences(target, n[0], cfg.seq_len, n[1], n[2], cfg.seed)
    else:
        from workers.gguf_loader import resolve_model_path

        target = resolve_model_path(a.target)
        if a.cache:
            build_chat_cache(target, a.work, Path(a.cache), 0 if a.quick else a.docs, a.max_text,
                             a.cache_minutes, 256 if a.quick else a.seq_len)
            if a.cache_only:
                return
        else:
            seqs, held = chat_sequences(target, a.work, 0 if a.quick else a.docs, cfg.seq_len), None
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.cache and a.target != "builtin":
        dcfg = DistillConfig(minutes=cfg.minutes, tokens=cfg.batch * cfg.seq_len, lr=a.lr or DistillConfig.lr,
                             text_frac=a.text_frac, bf16=a.bf16, eval_every_s=20 if a.quick else 300,
                             warmup_steps=1 if a.quick else DistillConfig.warmup_steps)
        if a.quick:
            dcfg.minutes = 0.05
        stats = train_cached(target, Path(a.cache), a.out, dcfg, a.draft_vocab, getattr(torch, a.save_dtype),
                             init=a.init)
    else:
        stats = train_head(target, seqs, a.out, cfg, held, save_dtype=getattr(torch, a.save_dtype))
    print(json.dumps({k: v for k, v in stats.items() if k != "config"}))
    prompts = heldout_prompts(a.target, a.work)
    acceptance = {} if a.quick or not prompts else heldout_acceptance(target, a.out, prompts[:16])
    print(json.dumps(acceptance))
    data = (f"{a.windows} stdlib windows (training/data.py's train split) and {a.gen} of the target's own "
            f"continuations of train-split prefixes (half greedy, half T = 0.8)" if a.target == "builtin" else
            f"the target's own answers in {a.work}/gen.jsonl (training.smollm2_draft gen)" + (
                f" ({stats.get('answers')} answers; {stats.get('text_sequences')} local documents as chat "
                f"turns; {stats.get('positions')} positions; features and top-{32} laws cached in {a.cache})"
                if a.cache else ""))
    write_card(a.out, a.target, target, stats, acceptance, data, "python -m training.eagle " + " ".join(argv or []))


def heldout_prompts(target_name: str, work: str) -> list:
    """Held-out prompts: the built-in prompt set (held-out files), or SmolLM2's held-out chat prompts."""
    from engine.core.config import DEFAULT_MODELS_DIR

    path = (DEFAULT_MODELS_DIR / "prompts.jsonl" if target_name == "builtin" else
            Path(work) / "heldout_prompts.jsonl")
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r.get("prompt_token_ids") or r["prompt"] for r in rows]


if __name__ == "__main__":
    main()
