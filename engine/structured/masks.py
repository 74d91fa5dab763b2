"""Grammar masks for the target's verification: one llguidance matcher per request, on the controller.

Where the matchers run and what crosses: the controller keeps each grammar request's matcher at its committed
output (caught up from ``Request.output_token_ids`` before each step: the kept tokens, after the stop rules). For
a round it walks the drafted tree depth first, advancing the matcher along each node's path and rolling it back
on the way up, and sends the target one packed mask row per logits row (row 0 at the root, row i + 1 after node
i): ``VerifySeq.allowed`` [N + 1, ceil(V / 32)] int32, and ``PrefillSeq.allowed`` [1, ...] for a prompt's first
token. Rank 0 of the target sets the disallowed logits to -inf before its transforms (workers/grammar_mask.py),
so p at every node is the target's law masked given that node's path. A node the grammar refuses gets p(x) = 0:
it is rejected whatever its q, and the rows under it are never read (they are left all-allowed).

Lossless with any drafter: the verifier needs q to be the law the draft actually drew from, which it is. The
draft model proposes from its own law masked the same way (workers/grammar_draft.py, a matcher beside the draft
model; its q is the masked law), so none of its nodes is refused (``refused`` counts them). Draftless drafters
(n-gram, suffix, layer_skip), pipelined drafting and EAGLE-2 dynamic trees propose unmasked: their refused nodes
are rejected (p = 0), never emitted. Requests with and without a grammar share a batch: only the former carry masks.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.torch
import torch

from engine.structured.grammar import check, ll_tokenizer, to_grammar
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch
from workers.messages import TargetStep
from workers.tree_topology import children_lists


class GrammarMasks:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf, self.vocab_size = tokenizer, vocab_size
        self._tok: llguidance.LLTokenizer | None = None  # built at the first grammar request (~1 s)
        self._matchers: dict[str, tuple[llguidance.LLMatcher, int]] = {}  # request id -> (matcher, tokens consumed)
        self.drafted = 0  # drafted nodes of grammar requests seen (below an allowed path)
        self.refused = 0  # of those, the ones the grammar refuses: 0 with a masked draft (workers/grammar_draft.py)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            self._tok = ll_tokenizer(self._hf, self.vocab_size)
        return self._tok

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError when the request's grammar does not compile (before it is queued)."""
        if params.structured_outputs is not None:
            check(to_grammar(params.structured_outputs), self.tokenizer)

    def ask(self, msg: TargetStep, batch: ScheduledBatch) -> None:
        """Put the masks on the message's grammar requests (the prompt's first token, every round's tree)."""
        for chunk, seq in zip(batch.prefills, msg.prefills, strict=True):
            if seq.sample is not None and chunk.req.params.structured_outputs is not None:
                seq.allowed = self._tree(self._matcher(chunk.req), [], [])
        for req, seq in zip(batch.rounds, msg.seqs, strict=True):
            if req.params.structured_outputs is not None:
                seq.allowed = self._tree(self._matcher(req), seq.tree_tokens, seq.tree_parents)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def _matcher(self, req: Request) -> llguidance.LLMatcher:
        """The request's matcher at its committed output (created at its first step, then caught up)."""
        m, done = self._matchers.get(req.request_id) or (None, 0)
        if m is None:
            m = llguidance.LLMatcher(self.tokenizer, to_grammar(req.params.structured_outputs))
        new = req.output_token_ids[done:]
        if new and m.validate_tokens(new) == len(new):
            m.consume_tokens(new)
        elif new:  # cannot happen for tokens drawn from masked laws; a resumed request's earlier tokens may
            raise ValueError(f"request {req.request_id}: its output left the grammar: {m.get_error()}")
        self._matchers[req.request_id] = (m, len(req.output_token_ids))
        return m

    def _tree(self, m: llguidance.LLMatcher, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """[N + 1, ceil(V / 32)] int32 packed masks: row 0 at the root, row i + 1 after node i's path."""
        masks = llguidance.torch.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        masks.fill_(-1)  # all allowed: the rows under a refused node are never read
        kids = children_lists(parents)

        def visit(slot: int) -> None:
            llguidance.torch.fill_next_token_bitmask(m, masks, slot)
            for c in kids[slot]:
                t = tokens[c]
                self.drafted += 1
                self.refused += not (int(masks[slot, t // 32]) >> (t % 32)) & 1  # p(t) = 0 at this node
                if m.validate_tokens([t]) == 1:  # (EOS where the grammar is complete is allowed, not consumed)
                    m.consume_token(t)
                    visit(c + 1)
                    m.rollback(1)

        visit(0)
        return masks
