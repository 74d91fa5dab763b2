"""What some requests ask of a step beyond their tokens, on the engine's side: logprobs and grammar masks.

The engine loop calls four hooks (``check`` when a request is queued; ``ask`` on the target's message; ``took``
on its output; ``attach`` on the step's deltas); each concern keeps its own state in its own module.
"""

from __future__ import annotations

from typing import Any

from engine.core.logprobs import LogprobRecorder
from engine.core.outputs import RequestDelta, RequestOutput
from engine.structured.masks import GrammarMasks
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledBatch
from workers.messages import TargetStep, TargetStepOutput


class StepExtras:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.logprobs = LogprobRecorder()
        self.grammar = GrammarMasks(tokenizer, vocab_size)

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field for anything the workers could not take (ranges, grammars)."""
        params.validate(self.vocab_size)
        self.grammar.check(params)

    def ask(self, msg: TargetStep, batch: ScheduledBatch) -> TargetStep:
        self.grammar.ask(msg, batch)
        return self.logprobs.ask(msg, batch)

    def took(self, out: TargetStepOutput, batch: ScheduledBatch) -> TargetStepOutput:
        return self.logprobs.took(out, batch)

    def attach(self, deltas: list[RequestDelta], outputs: list[RequestOutput]) -> list[RequestDelta]:
        self.grammar.forget([d.request_id for d in deltas if d.finished])
        return self.logprobs.attach(deltas, outputs)
