"""Mask time per token of llguidance vs xgrammar on SmolLM2's 49,152-token vocabulary (how issue 50 chose).

    pip install --no-deps --target /tmp/sg_xg xgrammar==0.2.8 apache-tvm-ffi   # kept out of the venv
    OMP_NUM_THREADS=1 python -m benchmarks.grammar_engines --engine llguidance
    OMP_NUM_THREADS=1 python -m benchmarks.grammar_engines --engine xgrammar --extra-path /tmp/sg_xg

One matcher compiles a JSON schema with bounded strings, then steps through a valid answer's tokens, filling the
next-token bitmask before each (the work a verified node costs); compile time and the mask time's median, mean,
p90 and max are printed. Each engine's non-flexible JSON has its own separators, so each gets the answer it
accepts (llguidance compact, xgrammar ", " and ": "). ``--no-bounds`` drops maxLength / maxItems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from workers.gguf_loader import resolve_model_path
from workers.loader import load_tokenizer

V = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 4},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace the first programmer", "age": 36, "tags": ["math", "engines", "poetry"], "ok": True}


def _unbounded(x):
    if isinstance(x, dict):
        return {k: _unbounded(v) for k, v in x.items() if k not in ("maxLength", "maxItems")}
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["llguidance", "xgrammar"], required=True)
    ap.add_argument("--extra-path", default=None, help="a folder to import the engine from (pip --target)")
    ap.add_argument("--no-bounds", action="store_true")
    args = ap.parse_args()
    if args.extra_path:
        sys.path.insert(0, args.extra_path)
    tok = load_tokenizer(resolve_model_path("smollm2"))
    schema = json.dumps(_unbounded(SCHEMA) if args.no_bounds else SCHEMA)
    compact = args.engine == "llguidance"
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":") if compact else None), add_special_tokens=False)
    times: list[float] = []
    if args.engine == "xgrammar":
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
        t = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(schema, any_whitespace=False)
        compile_s = time.perf_counter() - t
        m, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, V)
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t)
            assert m.accept_token(i), i
    else:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lt, g)
        compile_s = time.perf_counter() - t
        mask = llguidance.torch.allocate_token_bitmask(1, V)
        for i in ids:
            t = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t)
            assert m.consume_token(i), m.get_error()
    times.sort()
    print(f"{args.engine}: compile {compile_s * 1e3:.1f} ms; mask per token median {statistics.median(times) * 1e6:.0f}"
          f" us, mean {statistics.mean(times) * 1e6:.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:.0f} us, "
          f"max {times[-1] * 1e6:.0f} us over {len(times)} tokens")


if __name__ == "__main__":
    main()
