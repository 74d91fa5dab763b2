"""Builds benchmarks/copy_heavy_prompts.jsonl: chat prompts whose answers mostly copy the prompt (edit this
function, repeat this passage, quote the sentence that...), from local text only: functions and docstrings of
the Python standard library this interpreter ships. Deterministic for a given Python version.

    python -m benchmarks.make_copy_heavy            # rewrites the file next to this script
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "glob", "calendar", "string", "base64",
           "html", "json.encoder", "json.decoder", "csv", "difflib", "pprint")
MAX_CHARS = 900  # ~300 tokens: fits a 512-token context with room for a 128-token answer
OUT = Path(__file__).with_name("copy_heavy_prompts.jsonl")


def chat(text: str) -> str:
    """SmolLM2's ChatML turn (what the issue's measurement used); other tokenizers read it as plain text."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def functions(module: str) -> list[tuple[str, str, str]]:
    """(name, source, docstring) of the module's top-level functions, in file order."""
    spec = importlib.util.find_spec(module)
    src = Path(spec.origin).read_text(encoding="utf-8")
    tree = ast.parse(src)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out.append((node.name, ast.get_source_segment(src, node) or "", ast.get_docstring(node) or ""))
    return out


def build() -> list[dict]:
    rows: list[dict] = []
    for module in MODULES:
        funcs = [f for f in functions(module) if 120 <= len(f[1]) <= MAX_CHARS]
        for i, (name, source, _) in enumerate(funcs[:2]):
            if i == 0:
                task = (f"Rename the function `{name}` to `{name}_v2` and return the whole function, "
                        f"otherwise unchanged:\n\n```python\n{source}\n```")
                kind = "edit"
            else:
                task = ("Repeat this code exactly, adding type hints where they are missing:"
                        f"\n\n```python\n{source}\n```")
                kind = "repeat"
            rows.append({"id": f"{kind}:{module}.{name}", "prompt": chat(task), "max_tokens": 128})
        docs = [d for _, _, d in functions(module) if 200 <= len(d) <= MAX_CHARS]
        if docs:
            rows.append({"id": f"quote:{module}", "max_tokens": 128, "prompt": chat(
                f"Here is a passage from the documentation of Python's `{module}` module:\n\n{docs[0]}\n\n"
                "Quote the passage back word for word, then say in one sentence what it describes.")})
    return rows


def main() -> int:
    rows = build()
    with OUT.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} prompts from Python {sys.version.split()[0]}'s standard library -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
