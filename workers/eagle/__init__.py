"""EAGLE heads: a one-layer draft fed the target's hidden states (head, features, draft worker)."""
