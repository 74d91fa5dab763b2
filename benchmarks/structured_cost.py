"""What a grammar costs: mask time per token and per verify round, and tokens/s with a JSON schema vs without,
speculation (the built-in draft, a chain of 3) on and off, on the built-in pair (its 4,096-token vocabulary).

    OMP_NUM_THREADS=1 python -m benchmarks.structured_cost --prompts 8 --max-tokens 48 --repeats 2 [--unmasked-draft]

Modes run in turns, ``--repeats`` times; the best run of each is kept (a shared machine disturbs the others).
Mask time is the controller's (engine/structured/masks.py ``GrammarMasks._tree``: the tree walk and the packed
masks), timed by wrapping it, and the draft worker's (workers/grammar_draft.py ``DraftGrammarMasks.mask``, the
draft proposing from its masked law; in process, so timed the same way); tokens/s counts every generated token,
EOS-stopped answers included.
"""

from __future__ import annotations

import argparse
import json
import time

from engine.core.config import DEFAULT_MODELS_DIR
from engine.llm import LLM
from engine.structured.masks import GrammarMasks
from scheduler.sampling_params import SamplingParams
from workers.grammar_draft import DraftGrammarMasks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"type": "string", "maxLength": 8}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--unmasked-draft", action="store_true", help="also run speculation with the draft unmasked")
    args = ap.parse_args()
    prompts = [json.loads(x)["prompt"] for x in (DEFAULT_MODELS_DIR / "prompts.jsonl").read_text().splitlines()]
    prompts = prompts[: args.prompts]
    draft = {"method": "draft_model", "model": str(DEFAULT_MODELS_DIR / "draft"), "num_speculative_tokens": 3,
             "adaptive": False}
    timing = {"s": 0.0, "rows": 0, "calls": 0, "draft_s": 0.0}
    tree = GrammarMasks._tree

    def timed(self, m, tokens, parents):
        t = time.perf_counter()
        out = tree(self, m, tokens, parents)
        timing["s"] += time.perf_counter() - t
        timing["rows"] += len(tokens) + 1
        timing["calls"] += 1
        return out

    GrammarMasks._tree = timed
    draft_mask = DraftGrammarMasks.mask

    def draft_timed(self, logits, row_paths):
        t = time.perf_counter()
        out = draft_mask(self, logits, row_paths)
        timing["draft_s"] += time.perf_counter() - t
        return out

    DraftGrammarMasks.mask = draft_timed
    best: dict[tuple[str, str], tuple[float, dict]] = {}
    llms = {"spec": LLM(None, draft), "nospec": LLM(None, "none")}  # a fixed chain of 3: every round drafts
    if args.unmasked_draft:  # the draft proposing from its unmasked law, as before draft-side masks (the control)
        llms["spec-unmasked-draft"] = LLM(None, draft)
        llms["spec-unmasked-draft"].engine.drafter.grammars.update = lambda req: None
    try:
        for _ in range(args.repeats):
            for spec, llm in llms.items():
                for kind in ("plain", "schema"):
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                            structured_outputs={"json": SCHEMA} if kind == "schema" else None)
                    llm.generate(prompts[:1], params)  # the grammar tokenizer and compile, once
                    timing.update(s=0.0, rows=0, calls=0, draft_s=0.0)
                    llm.engine.reset_stats()
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    wall = time.perf_counter() - t
                    toks = sum(len(o.token_ids) for o in outs)
                    mal = llm.engine.stats.as_dict()["mean_acceptance_length"]
                    if (spec, kind) not in best or toks / wall > best[(spec, kind)][0]:
                        best[(spec, kind)] = (toks / wall, dict(timing, toks=toks, mal=mal))
    finally:
        for llm in llms.values():
            llm.shutdown()
    print("| speculation | output | tok/s | mean acceptance length | mask ms / token row | mask ms / verify round "
          "| draft mask ms / verify round | mask share of wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (spec, kind), (tps, t) in sorted(best.items()):
        per_row = 1e3 * t["s"] / t["rows"] if t["rows"] else 0.0
        per_round = 1e3 * t["s"] / t["calls"] if t["calls"] else 0.0
        draft_round = 1e3 * t["draft_s"] / t["calls"] if t["calls"] else 0.0
        share = (t["s"] + t["draft_s"]) / (t["toks"] / tps) if t["toks"] else 0.0
        print(f"| {spec} | {kind} | {tps:.1f} | {t['mal']} | {per_row:.3f} | {per_round:.3f} | {draft_round:.3f} "
              f"| {share:.1%} |")


if __name__ == "__main__":
    main()
