"""How close the 4-bit target with 8-bit activations ("q8") stays to the one with float32 activations ("f32"):
greedy text of both from the same chat prompts, and the number of tokens until the first one that differs.

    OMP_NUM_THREADS=1 python -m benchmarks.gguf_agreement --target smollm2 --max-tokens 96

The prompts below were written for this check (no engine test, drafter or benchmark trains or tunes on them).
"q8" is another model than "f32" (each activation is rounded to one of 255 levels per 32-block), so greedy text
agrees until a near-tie between the two best tokens flips, then goes its own way. ``--pair f32,torch`` gives the
same figure for the float32 model against torch's int4 path (bfloat16 activations), the model shipped before.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.gguf_decode import native_kernel
from workers.gguf_loader import resolve_model_path

PROMPTS = [
    "Write two sentences about why bread goes stale.",
    "List three uses for a paperclip other than holding paper.",
    "Explain what a hash table is to a ten-year-old.",
    "Give me a short packing list for a rainy weekend hike.",
    "What is the difference between weather and climate?",
    "Suggest a name for a cafe that only serves soup, and say why.",
    "Translate 'the library opens at nine' into French and Spanish.",
    "Describe the smell of a forest after rain in one paragraph.",
]


def greedy(path: str, activations: str, n: int) -> list[list[int]]:
    from engine import LLM, SamplingParams
    from workers.loader import load_tokenizer

    tok = load_tokenizer(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    native = activations != "torch"  # "torch": the native kernel off (torch's int4 path, bfloat16 activations)
    with native_kernel(native, activations if native else None):
        llm = LLM(path, None, quantization="gguf", num_kv_tokens=2048, max_num_seqs=1)
        used = llm_activations(llm) if native else "torch"
    if used != activations:
        raise SystemExit(f"asked for {activations!r} activations, the model runs {used!r}")
    params = SamplingParams(max_tokens=n, temperature=0.0)
    return [list(llm.generate([p], params)[0].token_ids) for p in prompts]


def llm_activations(llm: object) -> str:
    """The activations the engine's loaded target runs (its loader's report), "-" without the native kernel."""
    from workers.kernels import gguf_blocks
    from workers.quantized_linear import activations

    return activations() if gguf_blocks.available() else "-"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token that differs (None: equal, or one a prefix of the other that stopped at EOS)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gguf_agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pair", default="f32,q8", help="two of f32, q8, torch (the native kernel off): a baseline")
    args = ap.parse_args(argv)
    path = resolve_model_path(args.target)
    first, second = args.pair.split(",")
    f32, q8 = greedy(path, first, args.max_tokens), greedy(path, second, args.max_tokens)
    agree = []
    for prompt, a, b in zip(PROMPTS, f32, q8, strict=True):
        i = first_difference(a, b)
        agree.append(min(len(a), len(b)) if i is None else i)
        print(f"{'same' if i is None else f'first difference at token {i}':<32} ({len(a)} / {len(b)} tokens) {prompt}")
    same = sum(first_difference(a, b) is None for a, b in zip(f32, q8, strict=True))
    print(f"tokens until the first difference: median {statistics.median(agree)}, min {min(agree)}, "
          f"max {max(agree)}; {same} of {len(PROMPTS)} the same")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
