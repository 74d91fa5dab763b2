"""A draft for SmolLM2-135M-Instruct (``--target smollm2``), trained offline from the target itself.

    python -m training.smollm2_draft gen     --minutes 8              # target answers to composed instructions
    python -m training.smollm2_draft init    --vocab 5000 --layers 2  # draft = target's first layers, trimmed head
    python -m training.smollm2_draft distill --minutes 12             # KL(p_target || q_draft) on those answers
    python -m training.smollm2_draft measure --k 4 --max-tokens 96   # acceptance on held-out instructions
    python -m training.smollm2_draft all --quick --target DIR --work W --out D   # seconds (tests/test_smollm2_draft.py)

Stages (``--work`` holds intermediate files, default runs/smollm2_draft; ``--out`` the draft directory):

- ``gen``: instruction prompts composed from templates x topics (no data set download; ``compose_prompts``),
  wrapped in the target's own chat template, answered by the specserve engine on the target (the 4-bit GGUF as
  the engine runs it by default, no speculation, large batches), greedy and T = 0.7 alternately. A fixed slice
  of the prompts (every 10th composition, by index) is held out for measuring acceptance and never trained on.
  Writes ``WORK/gen.jsonl`` ({"prompt_ids", "answer_ids", "temperature", "heldout"}) and
  ``WORK/heldout_prompts.jsonl``.
- ``init``: the draft's vocabulary = the special tokens + the ids most frequent in the generated prompts and
  answers (``--vocab`` in all); its weights = the target's embedding rows for those ids (tied head), its first
  ``--layers`` decoder layers and its final norm (transformers dequantizes the GGUF). Writes ``OUT`` as an
  ordinary Llama checkpoint (fp16 safetensors) plus ``draft_vocab_map.json`` (workers/vocab_map.py).
- ``distill``: the target frozen (transformers, dequantized fp32); the draft minimises
  KL(p_target || q_draft) at every answer position, where p_target is the target's next-token law restricted
  to the draft's ids and renormalised (the draft can put mass nowhere else), from a no-grad target forward of
  the same batch (``--labels soft``); or, where CPU time is short, ``--labels hard``: cross-entropy on the
  target's own next tokens (sequence-level distillation; no target forward, ~5x the tokens per CPU second).
  AdamW, cosine schedule, time-bounded (``--minutes``), then writes ``OUT`` in fp16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

DEFAULT_WORK = "runs/smollm2_draft"
DEFAULT_OUT = "engine/default_models/smollm2-draft"

# ------------------------------------------------------------------------------------------------ prompts
TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Give me three facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "How would you describe {t} to a child?",
    "List some common questions people ask about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What should a beginner know about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Give me a tip related to {t}.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
]
TOPICS = [
    "photosynthesis", "the water cycle", "gravity", "black holes", "the moon", "volcanoes", "earthquakes",
    "the human heart", "sleep", "exercise", "healthy eating", "coffee", "tea", "bread baking", "chess",
    "soccer", "the Olympic Games", "the Roman Empire", "ancient Egypt", "the printing press", "electricity",
    "the internet", "computers", "programming in Python", "machine learning", "climate change", "recycling",
    "solar energy", "wind power", "the ocean", "rainforests", "deserts", "honey bees", "dogs", "cats",
    "elephants", "dinosaurs", "the solar system", "Mars", "music", "the piano", "painting", "poetry",
    "learning a language", "mathematics", "prime numbers", "fractions", "saving money", "time management",
    "friendship", "public speaking", "writing an email", "job interviews", "traveling by train", "Paris",
    "Japan", "mountains", "rivers", "snow", "thunderstorms", "vaccines", "bacteria", "DNA", "the brain",
    "memory", "happiness", "gardening", "tomatoes", "cooking pasta", "the bicycle", "cars", "airplanes",
    "rockets", "the telephone", "books", "libraries", "museums", "democracy", "taxes", "the economy",
]


def compose_prompts() -> list[str]:
    """Every template x topic, in a fixed shuffled order (seed 0)."""
    prompts = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    random.Random(0).shuffle(prompts)
    return prompts


def is_heldout(index: int) -> bool:
    return index % 10 == 0


# ------------------------------------------------------------------------------------------------ helpers
def _chat_ids(tok: Any, text: str) -> list[int]:
    """The prompt as the target's chat template writes it (plain text when the tokenizer has no template)."""
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
    return list(tok(text)["input_ids"])


def load_hf_target(target: str) -> Any:
    """The target as a transformers model (a GGUF file is dequantized to fp32 by transformers)."""
    from transformers import AutoModelForCausalLM

    from workers.gguf_loader import is_gguf, resolve_model_path

    path = resolve_model_path(target)
    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _read_gen(work: Path) -> list[dict]:
    with open(work / "gen.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------ gen
def gen(target: str, work: Path, minutes: float, max_tokens: int, batch: int, limit: int | None,
        quantization: str | None = None, append: bool = False) -> dict:
    from engine import LLM, SamplingParams

    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    llm = LLM(target, None, max_num_seqs=batch, max_model_len=512, quantization=quantization)
    tok = llm.tokenizer
    prompts = compose_prompts()[:limit]
    heldout = [{"prompt": p, "prompt_token_ids": _chat_ids(tok, p)} for i, p in enumerate(prompts) if is_heldout(i)]
    with open(work / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(h) + "\n" for h in heldout)
    train = [(i, p) for i, p in enumerate(prompts) if not is_heldout(i)]
    if append and (work / "gen.jsonl").is_file():  # resume: answer the prompts not answered yet
        done = {r["index"] for r in _read_gen(work)}
        train = [(i, p) for i, p in train if i not in done]
    n_tokens = answered = 0
    with open(work / "gen.jsonl", "a" if append else "w", encoding="utf-8") as out:
        for b in range(0, len(train), batch):
            if time.perf_counter() - start > minutes * 60:
                break
            chunk = train[b: b + batch]
            ids = [_chat_ids(tok, p) for _, p in chunk]
            params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 == 0 else 0.7, seed=i)
                      for i, _ in chunk]
            for (i, _), p_ids, sp, o in zip(chunk, ids, params, llm.generate(ids, params), strict=True):
                out.write(json.dumps({"index": i, "prompt_ids": p_ids, "answer_ids": list(o.token_ids),
                                      "temperature": sp.temperature}) + "\n")
                n_tokens += len(o.token_ids)
                answered += 1
            out.flush()
            print(f"gen: {answered}/{len(train)} prompts, {n_tokens} answer tokens, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    llm.shutdown()
    stats = {"gen_seconds": round(time.perf_counter() - start, 1), "answer_tokens": n_tokens,
             "train_prompts_answered": answered,
             "heldout_prompts": len(heldout)}
    (work / "gen_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


# ------------------------------------------------------------------------------------------------ init
def choose_vocab(rows: list[dict], tok: Any, size: int) -> list[int]:
    """Special tokens first, then the most frequent ids of the prompts + answers (ties: lower id first)."""
    special = sorted(set(getattr(tok, "all_special_ids", []) or []))
    counts = Counter()
    for r in rows:
        counts.update(r["prompt_ids"])
        counts.update(r["answer_ids"])
    ids = list(dict.fromkeys(special))
    seen = set(ids)
    # Then unseen ids in ascending order: a BPE vocabulary numbers its merges roughly by corpus frequency, the
    # best prior there is for tokens a few thousand answers never showed.
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    for t in ranked + list(range(len(tok))):
        if len(ids) >= size:
            break
        if t not in seen:
            ids.append(t)
            seen.add(t)
    return ids


def init(target: str, work: Path, out: Path, vocab: int, layers: int) -> dict:
    from safetensors.torch import save_file

    from workers.loader import load_tokenizer
    from workers.vocab_map import DraftVocabMap

    hf = load_hf_target(target)
    cfg = hf.config
    tok = load_tokenizer(_resolved(target))
    ids = choose_vocab(_read_gen(work), tok, vocab)
    idx = torch.tensor(ids)
    sd = hf.state_dict()
    new: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"][idx],
                                    "model.norm.weight": sd["model.norm.weight"]}
    for name, w in sd.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) < layers:
            new[name] = w
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in new.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    dcfg = cfg.to_dict()
    dcfg.update(num_hidden_layers=layers, vocab_size=len(ids), tie_word_embeddings=True, dtype="float16",
                architectures=["LlamaForCausalLM"], model_type="llama")
    dcfg.pop("torch_dtype", None)
    dcfg.pop("layer_types", None)
    # Rows' own ids for bos/eos/pad would point into the full vocabulary; the draft never needs them.
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        dcfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(dcfg, indent=1))
    fallback = ids.index(tok.unk_token_id) if getattr(tok, "unk_token_id", None) in ids else 0
    DraftVocabMap.build(ids, cfg.vocab_size, fallback).save(str(out))
    covered = _coverage(_read_gen(work), set(ids))
    stats = {"draft_vocab": len(ids), "layers": layers, "answer_token_coverage": round(covered, 4),
             "params": sum(v.numel() for v in new.values())}
    (work / "init_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def _resolved(target: str) -> str:
    from workers.gguf_loader import resolve_model_path

    return resolve_model_path(target)


def _coverage(rows: list[dict], ids: set[int]) -> float:
    total = sum(len(r["answer_ids"]) for r in rows)
    return sum(t in ids for r in rows for t in r["answer_ids"]) / max(1, total)


# ------------------------------------------------------------------------------------------------ distill
def _batches(rows: list[dict], batch: int, seq_len: int, rng: random.Random):
    """Forever: (ids [B, L], answer mask [B, L] marking positions whose NEXT token is an answer token, the rows'
    indices into ``rows``)."""
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for b in range(0, len(order) - batch + 1, batch):
            seqs, masks = [], []
            for j in order[b: b + batch]:
                p, a = rows[j]["prompt_ids"], rows[j]["answer_ids"]
                s = (p + a)[:seq_len]
                # Position i predicts token i + 1; the last position's next token is not in the (cut) sequence.
                m = ([0] * (len(p) - 1) + [1] * len(a))[:len(s) - 1] + [0]
                seqs.append(s)
                masks.append(m)
            n = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), n, dtype=torch.long)
            mask = torch.zeros(len(seqs), n, dtype=torch.bool)
            for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
            yield ids, mask, order[b: b + batch]


def distill(target: str, work: Path, out: Path, minutes: float, steps: int, batch: int, seq_len: int,
            lr: float, labels: str = "soft") -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from workers.vocab_map import DraftVocabMap

    start = time.perf_counter()
    rows = [r for r in _read_gen(work) if r["answer_ids"]]
    vmap = DraftVocabMap.load(str(out))
    assert vmap is not None, f"{out} has no draft_vocab_map.json: run init first"
    teacher = load_hf_target(target) if labels == "soft" else None
    if teacher is not None:
        for p in teacher.parameters():
            p.requires_grad_(False)
    student = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    local = vmap.local  # [Vt] full id -> draft row (fallback for ids off the map)
    head_ids = vmap.ids  # [Vd]
    rng = random.Random(0)
    batches = _batches(rows, batch, seq_len, rng)
    losses: list[float] = []
    cache: dict[int, torch.Tensor] = {}
    step = 0
    budget = minutes * 60
    while step < steps and time.perf_counter() - start < budget:
        ids, mask, which = next(batches)  # [B, L]
        s_logits = student(local[ids]).logits[mask]  # [M, Vd]
        if teacher is not None:
            # p per row, computed once and cached (fp16): a target forward costs ~15x a draft step, and the
            # rows come round again every epoch.
            for i, j in enumerate(which):
                if j not in cache:
                    n = int(mask[i].nonzero().max()) + 1  # the row's own length (past it: padding)
                    with torch.no_grad():
                        t_logits = teacher(ids[i: i + 1, :n]).logits[0][mask[i, :n]]  # [m, Vt]
                    cache[j] = torch.softmax(t_logits.index_select(-1, head_ids), dim=-1).half()  # [m, Vd]
            p = torch.cat([cache[j] for j in which]).float()  # [M, Vd]: restricted to the head, renormalised
            loss = -(p * torch.log_softmax(s_logits, dim=-1)).sum(-1).mean() + (p * p.clamp_min(1e-30).log()).sum(
                -1).mean()  # KL(p || q) = cross-entropy - entropy
        else:
            # Hard labels: the token the target itself chose next (its argmax in greedy answers, a sample of
            # p at T = 0.7 otherwise), where the draft's head has it: cross-entropy = KL to that one-hot.
            nxt = torch.roll(ids, -1, dims=1)[mask]  # [M] full-vocabulary ids
            on_map = head_ids[local[nxt]] == nxt  # [M]: off-map ids land on the fallback row's id
            if not bool(on_map.any()):
                continue
            loss = torch.nn.functional.cross_entropy(s_logits[on_map], local[nxt][on_map])
        frac = min(1.0, (time.perf_counter() - start) / budget, step / max(1, steps))
        for g in opt.param_groups:  # cosine decay by the larger of time and step progress
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * frac))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 10 == 0 or step == 1:
            print(f"distill: step {step} loss {sum(losses[-10:]) / len(losses[-10:]):.4f} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in student.state_dict().items()
          if k != "lm_head.weight"}  # tied: the head is the embedding
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    stats = {"distill_seconds": round(time.perf_counter() - start, 1), "steps": step, "batch": batch,
             "labels": labels,
             "seq_len": seq_len, "lr": lr, "loss_first10": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
             "loss_last10": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4)}
    (work / "distill_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


# ------------------------------------------------------------------------------------------------ measure
def measure(target: str, work: Path, out: Path, k: int, num_prompts: int, max_tokens: int,
            speed_prompts: int) -> dict:
    """Mean acceptance length at K = k, greedy, on the held-out instructions (all in one batch); then batch-1
    decode tokens/s with and without the draft on the first ``speed_prompts`` of them."""
    from engine import LLM, SamplingParams

    with open(work / "heldout_prompts.jsonl", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()][:num_prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    res: dict[str, Any] = {"k": k, "prompts": len(prompts), "max_tokens": max_tokens}
    llm = LLM(target, {"model": str(out), "num_speculative_tokens": k}, max_num_seqs=max(1, len(prompts)))
    t0 = time.perf_counter()
    spec_out = [o.token_ids for o in llm.generate(prompts, params)]
    s = llm.engine.stats
    res.update(mean_acceptance_length=round(s.mean_acceptance_length, 3), rounds=s.num_rounds,
               acceptance_per_position=[round(a, 3) for a in s.acceptance_per_position],
               batch_seconds=round(time.perf_counter() - t0, 1))
    speed: dict[str, float] = {}
    outs: dict[str, list] = {}
    plain = LLM(target, None, max_num_seqs=max(1, len(prompts)))
    plain_out = [o.token_ids for o in plain.generate(prompts, params)]
    for name, engine in (("no_spec", plain), ("spec", llm)):
        n, t0, outs[name] = 0, time.perf_counter(), []
        for p in prompts[:speed_prompts]:
            o = engine.generate([p], params)[0].token_ids
            outs[name].append(o)
            n += len(o)
        speed[name] = round(n / (time.perf_counter() - t0), 2)
    res["batch1_tokens_per_s"] = speed
    # Like with like: the same requests, one at a time, with and without the draft. (Batch 1 against the batch
    # above would also compare batch compositions: the packed 4-bit target's greedy output can differ with
    # the batch, speculation or not, since its int4 matmuls' rounding depends on the shapes.)
    res["greedy_identical"] = spec_out == plain_out and outs["spec"] == outs["no_spec"]
    llm.shutdown()
    plain.shutdown()
    (work / "measure.json").write_text(json.dumps(res, indent=1))
    return res


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["gen", "init", "distill", "measure", "all"])
    ap.add_argument("--target", default="smollm2", help="the target: a short name, *.gguf or checkpoint directory")
    ap.add_argument("--work", default=DEFAULT_WORK)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=None, help="time budget of gen / distill (default 8 / 12)")
    ap.add_argument("--max-tokens", type=int, default=160, help="gen: answer length cap")
    ap.add_argument("--gen-batch", type=int, default=48)
    ap.add_argument("--quantization", choices=["gguf", "none"], default=None,
                    help="gen: how the engine runs a GGUF target (default: by the file; 'none' = the same 4-bit "
                         "weights dequantized to fp32, much faster than the int4 kernel at large batch on CPU)")
    ap.add_argument("--append", action="store_true", help="gen: keep gen.jsonl and answer the remaining prompts")
    ap.add_argument("--limit", type=int, default=None, help="gen: use only the first N composed prompts")
    ap.add_argument("--vocab", type=int, default=5000, help="init: draft vocabulary size (special tokens incl.)")
    ap.add_argument("--layers", type=int, default=2, help="init: target decoder layers the draft starts from")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--labels", choices=["soft", "hard"], default="soft",
                    help="distill: soft = KL to the target's restricted law (a target forward per batch); hard = "
                         "cross-entropy on the target's own next tokens (no target forward: ~5x the tokens per "
                         "CPU second)")
    ap.add_argument("--k", type=int, default=4, help="measure: draft tokens per round")
    ap.add_argument("--num-prompts", type=int, default=32, help="measure: held-out prompts")
    ap.add_argument("--speed-prompts", type=int, default=3, help="measure: prompts timed at batch 1")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of seconds")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.limit, a.max_tokens, a.gen_batch, a.steps, a.batch, a.seq_len = 40, 8, 16, 3, 2, 64
        a.vocab = min(a.vocab, 64)
        a.layers = 1
    work, out = Path(a.work), Path(a.out)
    stages = ["gen", "init", "distill"] if a.stage == "all" else [a.stage]
    for s in stages:
        if s == "gen":
            r = gen(a.target, work, a.minutes or 8, a.max_tokens, a.gen_batch, a.limit, a.quantization, a.append)
        elif s == "init":
            r = init(a.target, work, out, a.vocab, a.layers)
        elif s == "measure":
            r = measure(a.target, work, out, a.k, a.num_prompts, a.max_tokens, a.speed_prompts)
        else:
            r = distill(a.target, work, out, a.minutes or 12, a.steps, a.batch, a.seq_len, a.lr, a.labels)
        print(f"{s}: {json.dumps(r)}", flush=True)


if __name__ == "__main__":
    main()
