"""Structured outputs: grammars (JSON schema, regex, choice, Lark) compiled with llguidance, and the per-request
matchers whose token masks the target applies at every verified node (engine/structured/masks.py)."""
