"""A request's structured-output spec (vLLM's ``structured_outputs`` keys) as an llguidance grammar.

Why llguidance (measured, docs/performance.md "Structured outputs"): on SmolLM2's 49,152-token vocabulary with a
schema of bounded strings, its mask costs ~0.3-1 ms per token against xgrammar 0.2.8's ~2-3 ms (p90 9-19 ms),
and it compiles a schema in ~1 ms where xgrammar took ~1-3 s, in the request path; it needs no other package.

JSON is compact (no free whitespace between tokens: ``{"a":1,"b":[2]}``): flexible whitespace lets a model pad
forever, and every answer is still valid JSON. ``choice`` is a Lark grammar of the literal strings.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's StructuredOutputsParams fields
_JSON_DEFAULTS = {"whitespace_flexible": False}


def to_grammar(spec: dict[str, Any]) -> str:
    """The llguidance grammar of one spec; raises ValueError naming what is wrong (exactly one kind is set)."""
    kinds = [k for k in KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(KINDS))
    if unknown or len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json" or kind == "json_object":
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs json: a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_DEFAULTS)
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError("structured_outputs regex: must be a string")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs choice: must be a list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str):
        raise ValueError("structured_outputs grammar: must be a Lark grammar string")
    return llguidance.LLMatcher.grammar_from_lark(value)


def check(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Compile once against the tokenizer: a grammar llguidance refuses is a ValueError with its message."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"structured_outputs: the grammar does not compile: {'; '.join(messages)}")


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer over the target's whole vocabulary (~1 s: build once)."""
    import llguidance.hf

    if hf_tokenizer is None:
        raise ValueError("structured_outputs: this model has no tokenizer, so no grammar can be matched")
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
