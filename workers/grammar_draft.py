"""Grammar masks on the draft worker: the drafter proposes from its own law masked the way the target's is.

The draft drafts K tokens in one call, so the controller cannot mask between its steps: a matcher lives here,
beside the draft model, one per grammar request (llguidance, the controller's engine/structured/ grammar).

What crosses processes (``DraftSeq.grammar``, a ``DraftGrammar``; msgpack, for grammar requests only):
- once per request (its first drafted round, and again after the worker dropped it): the grammar's text;
- per round: the committed output tokens since the last round (``start`` says how many the matcher has seen).
Nothing comes back: the laws the draft drew from go to the verifier as before (workers/law_channel.py).

Per round the matcher is caught up to the committed output (the state at the tree's anchor, the last committed
token, for an ordinary sequential round). At each frontier node the matcher is advanced along the node's path,
the next-token mask filled, and rolled back, so siblings never see each other. The draft's logits get -inf off
the mask before its transforms (temperature, top-k/p, min-p), so q, the law recorded for the verifier, is the
masked law the children were drawn from: verification stays lossless, and no drafted token is one the grammar
refuses. A row whose allowed tokens all lie outside the draft's vocabulary (a trimmed draft vocabulary, such as the
shipped SmolLM2 draft's 5,000 ids, which hold none of the JSON punctuation tokens) stays unmasked, and so do the
rows below a token drawn there: their q is the unmasked law they are drawn from (still lossless), and such a
token may be refused by the target.

Not masked (lossless, lower acceptance): trees below predicted tokens (pipelining sends no grammar), EAGLE-2
dynamic trees (workers/eagle/, their own growth; an EAGLE head's static trees are masked), and a request whose
committed output this worker's tokenizer cannot follow (a draft with a different tokenizer).
The tokenizer is the target's (``WorkerConfig.tokenizer``, given at start; else the draft checkpoint's own), over
the target's vocabulary; a draft without one (none given, none in its checkpoint) does not mask.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.grammar_mask import apply_allowed
from workers.messages import DraftGrammar


class DraftGrammarMasks:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self._path, self.vocab_size = tokenizer_path, vocab_size
        self._tok: Any = None  # llguidance.LLTokenizer, built at the first grammar request (~1 s); False: none
        self._matchers: dict[int, tuple[Any, int] | None] = {}  # seq_id -> (matcher, tokens consumed); None: off

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from engine.structured.grammar import ll_tokenizer
            from workers.loader import load_tokenizer

            hf = load_tokenizer(self._path)
            self._tok = ll_tokenizer(hf, self.vocab_size) if hf is not None else False
        return self._tok

    def drop(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self._matchers.pop(s, None)

    def matcher(self, seq_id: int, g: DraftGrammar) -> Any:
        """The request's matcher at its committed output, or None where this worker cannot mask it."""
        import llguidance

        if g.grammar:
            tok = self._tokenizer()
            self._matchers[seq_id] = (llguidance.LLMatcher(tok, g.grammar), 0) if tok else None
        entry = self._matchers.get(seq_id)
        if entry is None:
            return None
        m, done = entry
        if done != g.start:
            raise ValueError(f"draft grammar of sequence {seq_id}: the matcher has {done} tokens, the update starts "
                             f"at {g.start}")
        if g.tokens and m.validate_tokens(g.tokens) != len(g.tokens):
            self._matchers[seq_id] = None  # a tokenizer that cannot follow the target's output: stop masking
            return None
        m.consume_tokens(g.tokens)
        self._matchers[seq_id] = (m, done + len(g.tokens))
        return m

    def mask(self, logits: torch.Tensor, row_paths: list[tuple[Any, list[int]] | None]) -> torch.Tensor:
        """logits [R, Vd] -> [R, Vd] with each grammar row's refused tokens -inf. ``row_paths[i]``: (matcher at
        the anchor, tokens from the anchor down to row i's node), or None for a row left as it is."""
        import llguidance.torch

        packed = llguidance.torch.allocate_token_bitmask(len(row_paths), self.vocab_size)  # [R, ceil(V / 32)]
        packed.fill_(-1)
        for i, rp in enumerate(row_paths):
            if rp is None:
                continue
            m, path = rp
            if m.validate_tokens(path) != len(path):  # below a token drawn from an unmasked row (see above), or
                continue  # past EOS: left unmasked (its q is still the law it is drawn from)
            m.consume_tokens(path)
            llguidance.torch.fill_next_token_bitmask(m, packed, i)
            if path:
                m.rollback(len(path))
        masked = apply_allowed(logits, packed)  # [R, Vd]
        empty = torch.isinf(masked).all(dim=-1, keepdim=True)  # nothing allowed in the draft's vocabulary
        return torch.where(empty, logits, masked)
