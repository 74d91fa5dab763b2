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


# ------------------------------------------------------------------------------------------------ local text
# User turns for local documents, so that each document reads as an assistant's answer in the chat template.
TEXT_PROMPTS = [
    "Explain {t}.",
    "Tell me about {t}.",
    "What is {t}? Please describe it.",
    "Can you describe {t} in a few paragraphs?",
    "Write a short explanation of {t}.",
    "I am new to this. What should I know about {t}?",
]


def _text_roots() -> list[str]:
    """English prose already on this machine: the Python standard library's and the installed packages' sources
    (their docstrings) and documentation files. No download."""
    import sysconfig

    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], "/usr/share/doc"]
    return [r for r in dict.fromkeys(roots) if os.path.isdir(r)]


def _prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text`` that read as prose: mostly letters, no code or tables (a crude filter: the
    draft should learn the target's language, not its reading of argument tables)."""
    import inspect

    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        p = " ".join(line.strip() for line in para.splitlines()).strip()
        if len(p) < 120 or ">>>" in p or "::" in p or "|" in p or "(`" in p or p.count("`") > 4:
            continue
        letters = sum(c.isalpha() or c == " " for c in p)
        if letters / len(p) >= 0.88 and p[-1] in ".!?:" and p[0].isupper():
            out.append(p)
    return out


def local_documents(max_docs: int, seed: int = 0, roots: list[str] | None = None) -> list[tuple[str, str]]:
    """(topic, body) pairs of local English prose: docstrings (read with ``ast``, never imported or run) and
    .rst / .md / .txt files, each body 1-6 prose paragraphs; deduplicated; a fixed shuffled order."""
    import ast

    files: list[Path] = []
    for root in roots or _text_roots():
        for dirpath, _, names in os.walk(root):
            if "test" in dirpath.lower():
                continue
            files.extend(Path(dirpath) / n for n in names if n.endswith((".py", ".rst", ".md", ".txt")))
    files.sort()
    random.Random(seed).shuffle(files)
    docs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path in files:
        if len(docs) >= max_docs:
            break
        try:
            if path.stat().st_size > 2_000_000:
                continue
            src = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found: list[tuple[str, str]] = []
        if path.suffix == ".py":
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=True)
                    if doc and len(doc) > 200:
                        name = path.stem if isinstance(node, ast.Module) else node.name
                        kind = "module" if isinstance(node, ast.Module) else (
                            "class" if isinstance(node, ast.ClassDef) else "function")
                        found.append((f"the Python {kind} `{name}`", doc))
        else:
            found.append((path.stem.replace("_", " ").replace("-", " "), src))
        for topic, text in found:
            paras = [p for p in _prose_paragraphs(text) if p not in seen]
            for b in range(0, len(paras), 6):
                body = "\n\n".join(paras[b: b + 6])
                if len(body) >= 300:
                    docs.append((topic, body))
            seen.update(paras)
    return docs[:max_docs]


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
def choose_vocab(rows: list[dict], tok: Any, size: int, extra: list[list[int]] | None = None,
                 extra_weight: float = 0.2) -> list[int]:
    """Special tokens first, then the most frequent ids of the prompts + answers (ties: lower id first); ids of
    ``extra`` (the target's picks on local text) count ``extra_weight`` each — the draft's rows must cover the
    target's chat answers first."""
    special = sorted(set(getattr(tok, "all_special_ids", []) or []))
    counts: Counter = Counter()
    for r in rows:
        counts.update(r["prompt_ids"])
        counts.update(r["answer_ids"])
    for seq in extra or []:
        for t in seq:
            counts[t] += extra_weight
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


def init(target: str, work: Path, out: Path, vocab: int, layers: int, layer_ids: list[int] | None = None) -> dict:
    from safetensors.torch import save_file

    from workers.loader import load_tokenizer
    from workers.vocab_map import DraftVocabMap

    hf = load_hf_target(target)
    cfg = hf.config
    tok = load_tokenizer(_resolved(target))
    rows = _read_gen(work)
    # The target's own next-token choices on the labelled local text count too (its greedy pick at each position).
    labelled = _read_labels(work, ["text"])["text"] if (work / "labels").is_dir() else []
    ids = choose_vocab(rows, tok, vocab, [s["top_ids"][:, 0].tolist() for s in labelled])
    idx = torch.tensor(ids)
    # Which target layers the draft's layers start from (default: the first ``layers``).
    src_layers = layer_ids if layer_ids else list(range(layers))
    layers = len(src_layers)
    sd = hf.state_dict()
    new: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"][idx],
                                    "model.norm.weight": sd["model.norm.weight"]}
    for name, w in sd.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) in src_layers:
            parts = name.split(".")
            parts[2] = str(src_layers.index(int(parts[2])))
            new[".".join(parts)] = w
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
    covered = _coverage(rows, set(ids))
    stats = {"draft_vocab": len(ids), "layers": layers, "target_layers": src_layers,
             "answer_token_coverage": round(covered, 4), "params": sum(v.numel() for v in new.values()),
             "mb_fp16": round(2 * sum(v.numel() for v in new.values()) / 1e6, 2)}
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


def _train_step(opt: torch.optim.Optimizer, student: torch.nn.Module, loss: torch.Tensor, lr: float,
                losses: list[float]) -> None:
    """One clipped optimizer step at learning rate ``lr``; the loss is appended to ``losses``."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    losses.append(float(loss.detach()))


def _save_student(student: torch.nn.Module, out: Path) -> None:
    """fp16 safetensors without the head: it is tied to the embedding."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in student.state_dict().items()
          if k != "lm_head.weight"}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def distill(target: str, work: Path, out: Path, minutes: float, steps: int, batch: int, seq_len: int,
            lr: float, labels: str = "soft") -> dict:
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
        # cosine decay by the larger of time and step progress
        _train_step(opt, student, loss, lr * 0.5 * (1 + math.cos(math.pi * frac)), losses)
        step += 1
        if step % 10 == 0 or step == 1:
            print(f"distill: step {step} loss {sum(losses[-10:]) / len(losses[-10:]):.4f} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    _save_student(student, out)
    stats = {"distill_seconds": round(time.perf_counter() - start, 1), "steps": step, "batch": batch,
             "labels": labels,
             "seq_len": seq_len, "lr": lr, "loss_first10": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
             "loss_last10": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4)}
    (work / "distill_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


# ------------------------------------------------------------------------------------------------ label
LABEL_TOPK = 32


def _text_rows(tok: Any, n_docs: int, seq_len: int, roots: list[str] | None, work: Path) -> list[dict]:
    """Local documents as chat turns: a composed user request about the document's topic, the document as the
    assistant's answer (cut to ``seq_len`` tokens in all). The documents are read once and kept in
    ``WORK/local_docs.json`` (reading them parses thousands of files: minutes on a loaded machine)."""
    cache = work / "local_docs.json"
    key = {"n_docs": n_docs, "roots": roots}
    docs = None
    if cache.is_file():
        raw = json.loads(cache.read_text(encoding="utf-8"))
        docs = [tuple(d) for d in raw["docs"]] if raw.get("key") == key else None
    if docs is None:
        docs = local_documents(n_docs, roots=roots)
        cache.write_text(json.dumps({"key": key, "docs": docs}), encoding="utf-8")
    rows = []
    for i, (topic, body) in enumerate(docs):
        p = _chat_ids(tok, TEXT_PROMPTS[i % len(TEXT_PROMPTS)].format(t=topic))
        a = list(tok(body, add_special_tokens=False)["input_ids"])[: max(0, seq_len - len(p))]
        if len(a) >= 16:
            rows.append({"index": i, "prompt_ids": p, "answer_ids": a})
    return rows


def label(target: str, work: Path, source: str, minutes: float, seq_len: int, n_docs: int,
          roots: list[str] | None = None, dtype: str = "fp32", first: int = 0, shard_size: int = 64) -> dict:
    """Prefill distillation data: the target's top-``LABEL_TOPK`` next-token log-probabilities (full vocabulary,
    so the labels serve any draft vocabulary) at every answer position of each sequence, one no-grad target
    forward per sequence — ~100x cheaper per labelled token than having the target write answers.
    ``source`` 'gen': the target's own answers (gen.jsonl); 'text': local documents (``local_documents``).
    Writes ``WORK/labels/SOURCE-NNNN.safetensors`` shards; time-bounded (``minutes``). ``dtype`` 'bf16' runs
    the target in bfloat16 (~3x faster on CPUs with AMX/AVX-512 bf16; its top-1 matches fp32's at most positions,
    not all: labels, not a reference for exactness)."""
    from safetensors.torch import save_file

    from workers.loader import load_tokenizer

    start = time.perf_counter()
    tok = load_tokenizer(_resolved(target))
    work.mkdir(parents=True, exist_ok=True)
    rows = _read_gen(work) if source == "gen" else _text_rows(tok, n_docs, seq_len, roots, work)
    rows = [r for r in rows if r["answer_ids"]][first:]
    teacher = load_hf_target(target)
    if dtype == "bf16":
        teacher = teacher.to(torch.bfloat16)
    ldir = work / "labels"
    ldir.mkdir(parents=True, exist_ok=True)
    # A run from row ``first`` > 0 writes its own shards (another process may be labelling the rows before it).
    prefix = f"{source}-{first}-" if first else f"{source}-"
    for old in ldir.glob(f"{prefix}[0-9][0-9][0-9][0-9].safetensors"):
        old.unlink()
    buf: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
    n_tok = n_seq = shard = 0

    def flush() -> None:
        nonlocal shard, buf
        if not buf:
            return
        tensors = {
            "tokens": torch.tensor([t for s, *_ in buf for t in s], dtype=torch.int32),  # [N]
            "lengths": torch.tensor([len(s) for s, *_ in buf], dtype=torch.int32),  # [S]
            "mask": torch.cat([m for _, m, _, _ in buf]).to(torch.uint8),  # [N]: position predicts an answer token
            "top_ids": torch.cat([i for *_, i, _ in buf]).to(torch.int32),  # [M, k] M = mask.sum()
            "top_logp": torch.cat([lp for *_, lp in buf]).to(torch.float16),  # [M, k]
        }
        save_file(tensors, str(ldir / f"{prefix}{shard:04d}.safetensors"))
        shard += 1
        buf = []

    for r in rows:
        if time.perf_counter() - start > minutes * 60:
            break
        p, a = r["prompt_ids"], r["answer_ids"]
        s = (p + a)[:seq_len]
        m = torch.tensor(([0] * (len(p) - 1) + [1] * len(a))[:len(s) - 1] + [0], dtype=torch.bool)  # [L]
        if not bool(m.any()):
            continue
        with torch.no_grad():
            logp = torch.log_softmax(teacher(torch.tensor([s])).logits[0][m].float(), dim=-1)  # [M, Vt]
            top = logp.topk(LABEL_TOPK, dim=-1)
        buf.append((s, m, top.indices, top.values))
        n_seq += 1
        n_tok += int(m.sum())
        if len(buf) >= shard_size:
            flush()
            print(f"label {source}: {n_seq}/{len(rows)} sequences, {n_tok} labelled positions, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    flush()
    stats = {"source": source, "first": first, "sequences": n_seq, "of": len(rows), "labelled_positions": n_tok,
             "label_seconds": round(time.perf_counter() - start, 1), "seq_len": seq_len, "topk": LABEL_TOPK,
             "dtype": dtype}
    (work / f"label_{prefix.rstrip('-')}_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


def _read_labels(work: Path, sources: list[str]) -> dict[str, list[dict]]:
    """Label shards -> per source a list of sequences {"ids" [L], "mask" [L] bool, "top_ids" [m, k],
    "top_logp" [m, k]}. Source 'genhard' needs no shard: the target's own answers (gen.jsonl) as one-hot labels
    (all mass on one id: its greedy choice in greedy answers, a sample of its law at T = 0.7 otherwise — sequence-level
    distillation, free where labelling them would cost target forwards)."""
    from safetensors.torch import load_file

    out: dict[str, list[dict]] = {}
    for src in sources:
        seqs: list[dict] = []
        if src == "genhard":
            for r in _read_gen(work):
                p, a = r["prompt_ids"], r["answer_ids"]
                if not a:
                    continue
                ids = torch.tensor(p + a)  # [L]
                mask = torch.zeros(len(ids), dtype=torch.bool)
                mask[len(p) - 1: len(ids) - 1] = True  # position i predicts answer token i + 1
                # [m, k] like the shards' (so that sources mix in a batch): the token, then weight-0 copies.
                logp = torch.full((len(a), LABEL_TOPK), float("-inf"))
                logp[:, 0] = 0.0
                seqs.append({"ids": ids, "mask": mask, "top_ids": torch.tensor(a)[:, None].expand(-1, LABEL_TOPK),
                             "top_logp": logp})
            out[src] = seqs
            continue
        for f in sorted((work / "labels").glob(f"{src}-*.safetensors")):
            t = load_file(str(f))
            off = m_off = 0
            for n in t["lengths"].tolist():
                mask = t["mask"][off: off + n].bool()
                m = int(mask.sum())
                seqs.append({"ids": t["tokens"][off: off + n].long(), "mask": mask,
                             "top_ids": t["top_ids"][m_off: m_off + m].long(),
                             "top_logp": t["top_logp"][m_off: m_off + m].float()})
                off += n
                m_off += m
        out[src] = seqs
    return out


def _topk_target(top_ids: torch.Tensor, top_logp: torch.Tensor, vmap: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's law restricted to the draft's rows and renormalised, from its top-k: (rows [M, k] (draft
    rows; off-map entries -> row 0 with weight 0), probabilities [M, k]). Positions whose top-k has no draft row
    get all-zero weights (the caller drops them)."""
    rows = vmap.local[top_ids]  # [M, k]
    on = vmap.ids[rows] == top_ids  # [M, k]
    lp = top_logp.masked_fill(~on, float("-inf"))
    p = torch.softmax(lp, dim=-1).nan_to_num(0.0)  # [M, k]
    return rows.masked_fill(~on, 0), p


def _pad(seqs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences -> (ids [B, L] zero-padded, mask [B, L])."""
    n = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s["ids"])] = s["ids"]
        mask[i, :len(s["mask"])] = s["mask"]
    return ids, mask


def _agreement(student: Any, seqs: list[dict], vmap: Any, batch: int) -> float:
    """Top-1 agreement: the draft's argmax (as a full-vocabulary id) == the target's, over the sequences' answer
    positions — the per-token acceptance probability of greedy speculation on those contexts."""
    hit = tot = 0
    student.eval()
    with torch.no_grad():
        for b in range(0, len(seqs), batch):
            chunk = seqs[b: b + batch]
            ids, mask = _pad(chunk)
            pred = vmap.ids[student(vmap.local[ids]).logits[mask].argmax(-1)]  # [M] full ids
            want = torch.cat([s["top_ids"][:, 0] for s in chunk])  # [M]
            hit += int((pred == want).sum())
            tot += int(want.numel())
    student.train()
    return hit / max(1, tot)


def distill_topk(work: Path, out: Path, minutes: float, steps: int, batch: int, lr: float, sources: list[str],
                 repeat: dict[str, int], bf16: bool = False, seed: int = 0) -> dict:
    """KL(p_target || q_draft) from the label shards (``label``): p = the target's top-k restricted to the draft's
    rows and renormalised. No target forward here, so every CPU second goes to the draft. Every 20th sequence of
    each source is held out for the agreement figures."""
    from transformers import AutoModelForCausalLM

    from workers.vocab_map import DraftVocabMap

    start = time.perf_counter()
    vmap = DraftVocabMap.load(str(out))
    assert vmap is not None, f"{out} has no draft_vocab_map.json: run init first"
    data = _read_labels(work, sources)
    train: list[dict] = []
    held: dict[str, list[dict]] = {}
    for src, seqs in data.items():
        held[src] = seqs[::20][:64]
        train += [s for i, s in enumerate(seqs) if i % 20] * repeat.get(src, 1)
    assert train, f"no label shards for {sources} under {work / 'labels'}: run label first"
    student = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).train()
    agree0 = {src: round(_agreement(student, h, vmap, batch), 4) for src, h in held.items() if h}
    print(f"distill: {len(train)} training sequences, agreement before {agree0}", flush=True)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)  # another seed when continuing a run: another order of the sequences
    order: list[int] = []
    losses: list[float] = []
    step, budget, warmup = 0, minutes * 60, 20
    t_train = time.perf_counter()
    while step < steps and time.perf_counter() - start < budget:
        if len(order) < batch:
            order = list(range(len(train)))
            rng.shuffle(order)
        chunk = [train[order.pop()] for _ in range(batch)]
        ids, mask = _pad(chunk)  # [B, L]
        rows, p = _topk_target(torch.cat([s["top_ids"] for s in chunk]), torch.cat([s["top_logp"] for s in chunk]),
                               vmap)  # [M, k]
        # bf16 autocast: the draft's matmuls on the CPU's bf16 units (~3x fp32 here); weights and loss stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = student(vmap.local[ids]).logits[mask]  # [M, Vd]
        logq = torch.log_softmax(logits.float(), dim=-1)  # [M, Vd]
        keep = p.sum(-1) > 0  # [M]: positions whose top-k reaches the draft's rows
        loss = -(p * logq.gather(-1, rows)).sum(-1)[keep].mean() + (p * p.clamp_min(1e-30).log()).sum(-1)[keep].mean()
        frac = min(1.0, max((time.perf_counter() - t_train) / max(1.0, budget - (t_train - start)), step / steps))
        # warm-up, then cosine decay by the larger of time and step progress
        _train_step(opt, student, loss, lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * frac)),
                    losses)
        step += 1
        if step % 25 == 0 or step == 1:
            print(f"distill: step {step} loss {sum(losses[-25:]) / len(losses[-25:]):.4f} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    agree = {src: round(_agreement(student, h, vmap, batch), 4) for src, h in held.items() if h}
    _save_student(student, out)
    stats = {"distill_seconds": round(time.perf_counter() - start, 1), "steps": step, "batch": batch,
             "labels": "topk", "sources": sources, "repeat": repeat, "lr": lr, "bf16": bf16,
             "train_sequences": len(train), "train_positions": sum(int(s["mask"].sum()) for s in train),
             "heldout_agreement_before": agree0, "heldout_agreement_after": agree,
             "loss_first10": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
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
    ap.add_argument("stage", choices=["gen", "label", "init", "distill", "measure", "all"])
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
    ap.add_argument("--layer-ids", default=None,
                    help="init: the target layers to start from, comma-separated (e.g. 0,1,29); overrides --layers")
    ap.add_argument("--source", choices=["gen", "text"], default="text",
                    help="label: the target's answers (gen.jsonl) or local documents")
    ap.add_argument("--docs", type=int, default=4000, help="label --source text: local documents to read")
    ap.add_argument("--first", type=int, default=0,
                    help="label: start at this row (a second labelling process takes a later part of the rows)")
    ap.add_argument("--label-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="label: the target's compute dtype for the labels (bf16: ~3x faster where the CPU has "
                         "bf16 matmul units)")
    ap.add_argument("--text-root", action="append", default=None,
                    help="label --source text: a directory to read (repeatable; default: the Python standard "
                         "library, the installed packages, /usr/share/doc)")
    ap.add_argument("--sources", default="text,gen",
                    help="distill --labels topk: label sources to train on (text, gen: label shards; genhard: "
                         "gen.jsonl's answers as one-hot labels, no shard needed)")
    ap.add_argument("--repeat", default="gen=1",
                    help="distill --labels topk: times each source's sequences appear per epoch, e.g. gen=3")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--labels", choices=["soft", "hard", "topk"], default="soft",
                    help="distill: soft = KL to the target's restricted law (a target forward per batch); hard = "
                         "cross-entropy on the target's own next tokens (no target forward: ~5x the tokens per "
                         "CPU second); topk = KL to the target's top-k from the label stage's shards (no target "
                         "forward while training)")
    ap.add_argument("--bf16", action="store_true", help="distill --labels topk: bf16 autocast for the draft's matmuls")
    ap.add_argument("--seed", type=int, default=0, help="distill --labels topk: order of the training sequences")
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
        a.vocab, a.docs = min(a.vocab, 64), 24
        a.text_root = a.text_root or [str(Path(__file__).resolve().parent.parent / "docs")]  # seconds, not minutes
        a.layers = 1
    work, out = Path(a.work), Path(a.out)
    stages = ["gen", "init", "distill"] if a.stage == "all" else [a.stage]
    for s in stages:
        if s == "gen":
            r = gen(a.target, work, a.minutes or 8, a.max_tokens, a.gen_batch, a.limit, a.quantization, a.append)
        elif s == "label":
            r = label(a.target, work, a.source, a.minutes or 8, a.seq_len, a.docs, a.text_root, a.label_dtype,
                      a.first)
        elif s == "init":
            r = init(a.target, work, out, a.vocab, a.layers,
                     [int(x) for x in a.layer_ids.split(",")] if a.layer_ids else None)
        elif s == "measure":
            r = measure(a.target, work, out, a.k, a.num_prompts, a.max_tokens, a.speed_prompts)
        elif a.labels == "topk":
            rep = {k: int(v) for k, v in (kv.split("=") for kv in a.repeat.split(",") if kv)}
            r = distill_topk(work, out, a.minutes or 12, a.steps, a.batch, a.lr, a.sources.split(","), rep, a.bf16,
                             a.seed)
        else:
            r = distill(a.target, work, out, a.minutes or 12, a.steps, a.batch, a.seq_len, a.lr, a.labels)
        print(f"{s}: {json.dumps(r)}", flush=True)


if __name__ == "__main__":
    main()
