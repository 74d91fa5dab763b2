"""The controller's side of the draft worker's grammar masks (workers/grammar_draft.py): what to send each round.

For a grammar request it sends the grammar's text once (the first drafted round, or again after the worker
dropped the sequence: finished, preempted), then each round only the committed output tokens the worker's matcher
has not seen. Requests without a grammar send nothing (``DraftSeq.grammar`` stays None).
"""

from __future__ import annotations

from engine.structured.grammar import to_grammar
from scheduler.request import Request
from workers.messages import DraftGrammar


class DraftGrammars:
    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # seq_id -> output tokens the draft worker's matcher has consumed

    def update(self, req: Request) -> DraftGrammar | None:
        if req.params.structured_outputs is None:
            return None
        done = self._sent.get(req.seq_id)
        out = req.output_token_ids
        self._sent[req.seq_id] = len(out)
        if done is None:
            return DraftGrammar(to_grammar(req.params.structured_outputs), 0, list(out))
        return DraftGrammar("", done, list(out[done:]))

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences the draft worker drops with the next call (it drops their matchers too)."""
        for s in seq_ids:
            self._sent.pop(s, None)
