"""Corpus, held-out split and tokenizer for the built-in default models.

The corpus is the Python standard library that ships with the interpreter running the script, so it is
available offline on every machine. Test packages are excluded: they are large, repetitive and full of
odd edge-case code, and at our tiny training budget we would rather spend tokens on ordinary library code.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
HELDOUT_PERCENT = 5
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, with "/" separators; the split key
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    # Hash of the relative path: deterministic across runs and machines, independent of file order.
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def collect_files(root: Path | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """Return (train, heldout) files, each sorted by relative path."""
    root = root or stdlib_root()
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).parts
        if EXCLUDED_DIRS.intersection(rel_parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files use latin-1 on purpose; skipping them costs nothing
        if not text.strip():
            continue
        rel = "/".join(rel_parts)
        (heldout if is_heldout(rel) else train).append(SourceFile(rel, text))
    return train, heldout


def train_tokenizer(files: list[SourceFile], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is representable, so decoding round-trips any source text exactly."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would change the code and break exact round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    return tok


# Chat for a code model: system and user messages become Python comments, assistant messages are code, and the
# model continues with code after the last comment (``specserve serve``'s /v1/chat/completions uses it).
CHAT_TEMPLATE = ('{% for message in messages %}'
                 "{% if message['role'] == 'assistant' %}{{ message['content'] }}\n"
                 "{% else %}# {{ message['content'] | replace('\\n', '\\n# ') }}\n"
                 '{% endif %}{% endfor %}')


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Save in Hugging Face format (tokenizer.json + tokenizer_config.json + special_tokens_map.json)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # the default cleanup would eat spaces before punctuation
    )
    hf.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name ("TokenizersBackend"), which 4.x (still allowed by our
    # pyproject) cannot resolve; the generic fast-tokenizer name loads in both.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def encode_files(tok: Tokenizer, files: list[SourceFile]) -> np.ndarray:
    """One token stream: EOS, file, EOS, file, ... (EOS doubles as BOS, as in GPT-2)."""
    eos_id = tok.token_to_id(EOS)
    encs = tok.encode_batch([f.text for f in files])
    parts: list[np.ndarray] = []
    for enc in encs:
        parts.append(np.array([eos_id], dtype=np.uint16))
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
    parts.append(np.array([eos_id], dtype=np.uint16))
    return np.concatenate(parts)


def build_data(work_dir: Path, vocab_size: int, model_max_length: int) -> dict[str, object]:
    """Train the tokenizer and write tokenizer/ + train.npy + heldout.npy into work_dir."""
    work_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = collect_files()
    tok = train_tokenizer(train, vocab_size)
    tok_dir = work_dir / "tokenizer"
    save_hf_tokenizer(tok, tok_dir, model_max_length)
    train_ids = encode_files(tok, train)
    heldout_ids = encode_files(tok, heldout)
    np.save(work_dir / "train.npy", train_ids)
    np.save(work_dir / "heldout.npy", heldout_ids)
    (work_dir / "heldout_files.json").write_text(json.dumps([f.rel for f in heldout], indent=0))
    stats: dict[str, object] = {
        "stdlib_root": str(stdlib_root()),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(f.text.encode()) for f in train),
        "heldout_bytes": sum(len(f.text.encode()) for f in heldout),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "vocab_size": tok.get_vocab_size(),
    }
    (work_dir / "data_stats.json").write_text(json.dumps(stats, indent=2))
    return stats
