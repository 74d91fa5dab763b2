"""Held-out prompt set for acceptance measurements: engine/default_models/prompts.jsonl.

Two kinds, taken only from held-out files so neither model has seen the continuation:
  sig-*:    a `def` line through the end of its docstring (the model should write the body);
  prefix-*: a `def` line plus the first ~20 lines of its body, cut mid-function.
"""

from __future__ import annotations

import ast
import json
import random
import textwrap
from collections.abc import Callable
from pathlib import Path

from training.data import SourceFile

MAX_PROMPT_TOKENS = 300
PREFIX_BODY_LINES = 20


def _candidates(f: SourceFile) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(signature+docstring, prefix) candidates of one file, as (id suffix, prompt text) pairs."""
    try:
        tree = ast.parse(f.text)
    except SyntaxError:
        return [], []
    lines = f.text.splitlines(keepends=True)
    sigs: list[tuple[str, str]] = []
    prefixes: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        start = node.lineno - 1  # the `def` line; decorators are left out on purpose
        tag = f"{f.rel}:{node.lineno}:{node.name}"
        first = node.body[0]
        has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                   and isinstance(first.value.value, str))
        # Dedent so methods look like top-level functions: prompts should not start with stray indentation.
        if has_doc and len(node.body) > 1 and first.end_lineno is not None:
            sigs.append((tag, textwrap.dedent("".join(lines[start : first.end_lineno]))))
        end = node.end_lineno or node.lineno
        body_start = node.body[0].lineno - 1
        if end - body_start > PREFIX_BODY_LINES + 5:  # leave a real remainder to continue
            prefixes.append((tag, textwrap.dedent("".join(lines[start : body_start + PREFIX_BODY_LINES]))))
    return sigs, prefixes


def _pick(per_file: list[list[tuple[str, str]]], n: int, rng: random.Random,
          fits: Callable[[str], bool]) -> list[tuple[str, str]]:
    """Round-robin over files (shuffled within each) so no single big module dominates the set."""
    pools = [[c for c in cands if fits(c[1])] for cands in per_file]
    for pool in pools:
        rng.shuffle(pool)
    picked: list[tuple[str, str]] = []
    while len(picked) < n and any(pools):
        for pool in pools:
            if pool and len(picked) < n:
                picked.append(pool.pop())
    return picked


def build_prompts(heldout: list[SourceFile], out_path: Path, tokenizer_dir: str, seed: int = 1234,
                  n_each: int = 32, max_tokens: int = 128) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def fits(text: str) -> bool:
        return 8 <= len(tok(text)["input_ids"]) <= MAX_PROMPT_TOKENS

    rng = random.Random(seed)
    sig_lists, prefix_lists = zip(*(_candidates(f) for f in sorted(heldout, key=lambda f: f.rel)), strict=True)
    sigs = _pick(list(sig_lists), n_each, rng, fits)
    prefixes = _pick(list(prefix_lists), n_each, rng, fits)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as fh:
        for kind, items in (("sig", sigs), ("prefix", prefixes)):
            for i, (tag, text) in enumerate(items):
                # Sampling settings for `specserve generate` only (benchmarks read just the prompt and set
                # their own): this small target loops when greedy and is noisy at T=1; T=0.6 with top-p 0.9
                # reads most like code.
                rec = {"id": f"{kind}-{i:02d}:{tag}", "prompt": text, "max_tokens": max_tokens,
                       "temperature": 0.6, "top_p": 0.9}
                fh.write(json.dumps(rec) + "\n")
    return {"signature_prompts": len(sigs), "prefix_prompts": len(prefixes)}
