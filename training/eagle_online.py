"""python -m training.eagle_online: write the data and train an EAGLE-3 head with the target beside it (a GPU).

On this project's 2-core CPU the SmolLM2 head was limited by data: the target answered ~400 instructions in 35
minutes (43k tokens) and the head overfit (held-out top-1 0.42, train 0.73). With an accelerator the target writes
millions of answer tokens in minutes, and its features and laws are computed for every batch as training runs (no
cache to store). The objective is training/eagle_distill.py's (training-time test, answer positions only, the
target's top-32 law on the draft vocabulary); the head is written in the published layout.

    python -m training.eagle_online --target smollm2 --out runs/head_gpu --device cuda \\
        --samples 12 --self-instruct 8192 --gen-minutes 3 --minutes 4 --tokens 32768
    python -m training.eagle_online --target smollm2 --out /tmp/q --quick     # a CPU smoke run of ~a minute

Data, all written by the target (no data set): ``samples`` answers to each composed training instruction
(training/smollm2_draft.py's templates x topics, its held-out tenth never used; one greedy, the rest sampled at
``temperatures`` in turn), plus ``self_instruct`` instructions the target writes itself when its chat template is
opened at a user turn (Magpie's trick: no seed data), each answered greedily and at T = 0.8. The held-out
instructions' greedy answers give the teacher-forced agreement the run reports. The answers are kept
(OUT/gen-N.jsonl.gz, training.smollm2_draft's ``gen.jsonl`` rows) so a CPU run can train from them too.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.eagle_distill import Batch, DistillConfig, agreement, draft_local, optimise

CACHE_TOPK = 32  # the target's law kept per position (the head learns its top; as training/eagle_cache.py)


@dataclass
class GenConfig:
    minutes: float = 3.0  # wall-clock budget for all answers (instructions answered first, then self-instruct)
    samples: int = 8  # answers per training instruction: 1 greedy + sampled ones (more: more varied contexts)
    temperatures: tuple[float, ...] = (0.8, 0.6, 1.0)  # the sampled answers' temperatures, in turn
    self_instruct: int = 4096  # instructions the target writes itself (0: none); each answered twice
    max_tokens: int = 192  # answer length cap (longer: fewer answers in the budget)
    batch: int = 1024  # sequences per generate call (memory: KV of batch x (prompt + max_tokens))
    instructions: int | None = None  # the first N training (and N / 9 held-out) instructions; None: all 1,080
    seed: int = 0


@dataclass
class Seq:
    ids: list[int]  # prompt + answer
    answer_start: int


def chat_prefix(tok: Any) -> list[int] | None:
    """The chat template's ids up to where a user's message starts (None without a template)."""
    if not getattr(tok, "chat_template", None):
        return None
    mark = "\u2063MSG\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    return list(tok(text.split(mark)[0], add_special_tokens=False)["input_ids"])


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch: ids [B, n] and attention mask [B, n]."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, n - len(p):] = torch.tensor(p)
        mask[r, n - len(p):] = 1
    return ids, mask


def sampling(temperature: float) -> dict:
    """transformers ``generate`` keys for plain sampling at ``temperature`` (no top-k / top-p), greedy at 0."""
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}


def pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def temperature_groups(cfg: GenConfig) -> list[tuple[float, int]]:
    """(temperature, answers per instruction): one greedy, then the sampled copies grouped by temperature (one
    generate stream per temperature: full batches). Self-written instructions go after the second group."""
    copies = [cfg.temperatures[s % len(cfg.temperatures)] for s in range(cfg.samples - 1)]
    return [(0.0, 1)] + [(t, copies.count(t)) for t in cfg.temperatures if copies.count(t)]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], temperature: float, max_tokens: int, batch: int,
             eos: int, pad: int, deadline: float, seed: int) -> list[list[int] | None]:
    """Each prompt's continuation up to ``eos`` (kept) or ``max_tokens``; None for prompts the deadline left."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad little
    out: list[list[int] | None] = [None] * len(prompts)
    for b in range(0, len(order), batch):
        if time.perf_counter() > deadline:
            break
        idx = order[b: b + batch]
        ids, mask = left_padded([prompts[i] for i in idx], pad)
        torch.manual_seed(seed + b)
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                              eos_token_id=eos, pad_token_id=pad, **sampling(temperature))[:, ids.shape[1]:].tolist()
        for r, i in enumerate(idx):
            toks = seqs[r]
            out[i] = toks[: toks.index(eos) + 1] if eos in toks else toks
    return out


def self_written_instructions(model: torch.nn.Module, tok: Any, cfg: GenConfig, deadline: float) -> list[str]:
    """Instructions the target writes itself when its chat template is opened at a user turn (Magpie's trick):
    the finished turns of 8-400 characters, sorted; none without a template."""
    prefix = chat_prefix(tok)
    if not cfg.self_instruct or prefix is None or time.perf_counter() > deadline:
        return []
    eos = tok.eos_token_id
    asks = generate(model, [prefix] * cfg.self_instruct, 1.0, 64, cfg.batch, eos, pad_id(tok), deadline,
                    cfg.seed + 7)
    texts = {tok.decode(a[:-1], skip_special_tokens=True).strip() for a in asks if a and a[-1] == eos}
    return sorted(x for x in texts if 8 <= len(x) <= 400)


def write_data(tok: Any, model: torch.nn.Module, cfg: GenConfig, work: Path, log=print
               ) -> tuple[list[dict], list[dict]]:
    """The training rows and the held-out rows ({"index", "prompt_ids", "answer_ids", "temperature"})."""
    from training.smollm2_draft import _chat_ids, compose_prompts, is_heldout

    start = time.perf_counter()
    deadline = start + cfg.minutes * 60
    eos, pad = tok.eos_token_id, pad_id(tok)
    prompts = compose_prompts()
    held = [(i, _chat_ids(tok, p)) for i, p in enumerate(prompts) if is_heldout(i)]
    train = [(i, _chat_ids(tok, p)) for i, p in enumerate(prompts) if not is_heldout(i)]
    if cfg.instructions is not None:
        train, held = train[: cfg.instructions], held[: max(1, cfg.instructions // 9)]
    rows: list[dict] = []

    def answer(items: list[tuple[int, list[int]]], temperature: float, seed: int) -> list[dict]:
        got = generate(model, [p for _, p in items], temperature, cfg.max_tokens, cfg.batch, eos, pad, deadline, seed)
        return [{"index": i, "prompt_ids": p, "answer_ids": a, "temperature": temperature}
                for (i, p), a in zip(items, got, strict=True) if a]

    heldout = answer(held, 0.0, cfg.seed)
    groups = temperature_groups(cfg)
    for g, (t, n) in enumerate(groups):
        rows += answer(train * n, t, cfg.seed + 1000 * (g + 1))
        log(f"gen: {n} answer(s) each at T = {t}, {len(rows)} answers, "
            f"{sum(len(r['answer_ids']) for r in rows)} tokens, {time.perf_counter() - start:.0f} s")
        if g == 1 or len(groups) == 1:  # after the first temperature: a short budget still has some
            own = [(100_000 + j, _chat_ids(tok, x))
                   for j, x in enumerate(self_written_instructions(model, tok, cfg, deadline))]
            for t2 in (0.0, 0.8):
                rows += answer(own, t2, cfg.seed + 99 + int(10 * t2))
            if own:
                log(f"gen: {len(own)} self-written instructions answered, {len(rows)} answers in all, "
                    f"{time.perf_counter() - start:.0f} s")
    work.mkdir(parents=True, exist_ok=True)
    for part in range(0, len(rows), 30_000):  # parts of <= ~12 MB compressed
        with gzip.open(work / f"gen-{part // 30_000}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[part: part + 30_000])
    with open(work / "heldout.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in heldout)
    log(f"gen: done, {len(rows)} answers, {len(heldout)} held out, {time.perf_counter() - start:.0f} s")
    return rows, heldout


def padded_batch(seqs: list[Seq], teacher: torch.nn.Module, aux_layers: tuple[int, ...], local: torch.Tensor,
                 chunk: int = 32) -> Batch:
    """B sequences right-padded to one length n (rows B * n) as training/eagle_distill.py's ``Batch``, on the
    target's device, its features and laws from the target's own forward (pad rows: never scored, never seen)."""
    b, n = len(seqs), max(len(s.ids) for s in seqs)
    ids = torch.zeros(b, n, dtype=torch.long)
    label = torch.zeros(b, n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        label[i, max(s.answer_start - 1, 0): len(s.ids) - 1] = True  # position j predicts token j + 1
    ids = ids.to(local.device)
    aux, top_ids, top_lp = [], [], []
    with torch.no_grad():
        for c in range(0, b, chunk):  # the full-vocabulary logits of a chunk only
            out = teacher(ids[c: c + chunk], output_hidden_states=True)  # right pads: causal rows never see them
            aux.append(torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1))  # [b, n, F]
            top = torch.log_softmax(out.logits.float(), dim=-1).topk(CACHE_TOPK, dim=-1)  # [b, n, k]
            top_ids.append(top.indices)
            top_lp.append(top.values)
    flat = lambda xs: torch.cat(xs).reshape(b * n, -1)  # noqa: E731  [B, n, X] chunks -> [N, X]
    return Batch([n] * b, ids.reshape(-1), flat(aux), flat(top_ids), flat(top_lp), label.reshape(-1).to(local.device),
                 local)


def batches(seqs: list[Seq], tokens: int, rng: random.Random) -> list[list[Seq]]:
    """Sequences sorted by length, cut into batches of about ``tokens`` padded rows, in a shuffled order."""
    order = sorted(seqs, key=lambda s: len(s.ids))
    out, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s.ids) > tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def train(teacher: torch.nn.Module, head: torch.nn.Module, aux_layers: tuple[int, ...], data: list[Seq],
          held: list[Seq], cfg: DistillConfig, checkpoint=None, log=print) -> dict:
    """Train ``head`` in place for ``cfg.minutes`` (training/eagle_distill.py's loop); features from ``teacher``."""
    device = next(head.parameters()).device
    local = draft_local(head.draft_ids, head.head_config.vocab_size).to(device)
    rng = random.Random(cfg.seed)
    queue: list[list[Seq]] = []
    epochs = 0

    def next_batch() -> Batch:
        nonlocal queue, epochs
        if not queue:
            queue, epochs = batches(data, cfg.tokens, rng), epochs + 1
        return padded_batch(queue.pop(), teacher, aux_layers, local)

    def heldout() -> list[float]:
        return agreement(head, (padded_batch(c, teacher, aux_layers, local)
                                for c in batches(held, cfg.tokens, random.Random(0))), cfg.ttt_steps)

    stats = optimise(head, next_batch, heldout if held else None, cfg, checkpoint, log)
    return {**stats, "epochs": epochs}


@dataclass
class OnlineRun:
    target: str
    out: str
    device: str = "cpu"
    draft_vocab: int | None = 4096  # trimmed lm_head rows: the most frequent answer tokens
    save_dtype: str = "float16"
    gen: GenConfig = field(default_factory=GenConfig)
    train: DistillConfig = field(default_factory=lambda: DistillConfig(tokens=32768, eval_every_s=60.0))


def run(r: OnlineRun, log=print) -> dict:
    from training.eagle import init_head
    from training.eagle_layout import save_head
    from training.smollm2_draft import load_hf_target
    from workers.eagle.head_config import EagleHeadConfig
    from workers.gguf_loader import resolve_model_path
    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True  # the head's and the teacher's matmuls (labels, not a reference)
    target = resolve_model_path(r.target)
    tcfg = ModelConfig.from_pretrained(target)
    tok = load_tokenizer(target)
    teacher = load_hf_target(target).to(r.device)
    # answers only: bfloat16 where it is fast (a GPU), speed over bits
    writer = copy.deepcopy(teacher).to(torch.bfloat16) if r.device.startswith("cuda") else teacher
    log(f"loaded {target} on {r.device} in {time.perf_counter() - t0:.0f} s")
    rows, held_rows = write_data(tok, writer, r.gen, Path(r.out), log)
    del writer
    data = [Seq(x["prompt_ids"] + x["answer_ids"], len(x["prompt_ids"])) for x in rows]
    held = [Seq(x["prompt_ids"] + x["answer_ids"], len(x["prompt_ids"])) for x in held_rows]
    counts = torch.bincount(torch.tensor([t for x in rows for t in x["answer_ids"]]), minlength=tcfg.vocab_size)
    draft_ids = sorted(counts.topk(min(r.draft_vocab, tcfg.vocab_size)).indices.tolist()) if r.draft_vocab else None
    head, config = init_head(target, tcfg, teacher, draft_ids, r.train.seed)
    head = head.to(r.device)
    aux = EagleHeadConfig.from_dict(config).aux_layers(tcfg.num_layers)
    ids = torch.tensor(draft_ids) if draft_ids else None
    dtype = getattr(torch, r.save_dtype)
    stats = train(teacher, head, tuple(aux), data, held, r.train,
                  lambda: save_head(r.out, config, head, ids, dtype), log)
    save_head(r.out, config, head, ids, dtype)
    stats.update(answers=len(rows), answer_tokens=int(sum(len(x["answer_ids"]) for x in rows)),
                 heldout_sequences=len(held), device=r.device, total_seconds=round(time.perf_counter() - t0),
                 gen=asdict(r.gen), config=asdict(r.train))
    with open(os.path.join(r.out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.eagle_online", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2", help="smollm2, a GGUF file or a checkpoint directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--draft-vocab", type=int, default=OnlineRun.draft_vocab)
    ap.add_argument("--samples", type=int, default=GenConfig.samples)
    ap.add_argument("--self-instruct", type=int, default=GenConfig.self_instruct)
    ap.add_argument("--max-tokens", type=int, default=GenConfig.max_tokens)
    ap.add_argument("--gen-batch", type=int, default=GenConfig.batch)
    ap.add_argument("--gen-minutes", type=float, default=GenConfig.minutes)
    ap.add_argument("--minutes", type=float, default=4.0, help="training budget")
    ap.add_argument("--tokens", type=int, default=32768, help="padded rows per optimiser step")
    ap.add_argument("--lr", type=float, default=DistillConfig.lr)
    ap.add_argument("--quick", action="store_true", help="a smoke run (tiny budgets; the weights are useless)")
    a = ap.parse_args(argv)
    gen = GenConfig(minutes=a.gen_minutes, samples=a.samples, self_instruct=a.self_instruct, max_tokens=a.max_tokens,
                    batch=a.gen_batch)
    tcfg = DistillConfig(minutes=a.minutes, tokens=a.tokens, lr=a.lr, eval_every_s=60.0)
    if a.quick:
        gen = GenConfig(minutes=0.5, samples=2, self_instruct=8, max_tokens=8, batch=64, instructions=18)
        tcfg = DistillConfig(minutes=0.1, tokens=512, lr=a.lr, eval_every_s=3.0, warmup_steps=1)
    stats = run(OnlineRun(a.target, a.out, a.device, a.draft_vocab, gen=gen, train=tcfg))
    print(json.dumps({k: v for k, v in stats.items() if k not in ("config", "gen")}), flush=True)


if __name__ == "__main__":
    main()
