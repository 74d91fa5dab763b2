"""The engine's side of logprobs: ask the target for them, then hand them out with each request's deltas.

The target computes them in the forward it runs anyway (workers/logprobs.py) and returns them by seq id with the
step's output; this recorder, keyed by the user's request id, cuts a round's values to the tokens the stop
rules kept (the delta's ``new_token_ids``) and attaches them to the deltas and to the finished whole outputs.

Prompt logprobs (``echo``): a chunk's rows score the prompt tokens after each of its positions, so every chunk of
such a request asks for all its rows and names the token after it. A cached prefix has no logits, so these
requests bypass the prefix cache (scheduler: ``Scheduler._attach_cached``), as vLLM does; a chunk re-run after
a preemption does not overwrite what was recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import Logprob, RequestDelta, RequestOutput
from scheduler.request import Request
from scheduler.scheduler import ScheduledBatch
from workers.messages import TargetStep, TargetStepOutput, TokenLogprobs


def to_logprobs(tl: TokenLogprobs, tokens: list[int]) -> list[Logprob]:
    return [Logprob(t, lp, list(zip(ids, vals, strict=True)))
            for t, lp, ids, vals in zip(tokens, tl.logprobs, tl.top_ids, tl.top_logprobs, strict=False)]


@dataclass
class _Record:
    seq_id: int
    want_output: bool  # SamplingParams.logprobs is set
    prompt: list[Logprob | None] | None  # by position, when asked; None until known (position 0 stays None)
    pending: TokenLogprobs | None = None  # this step's values, not yet cut to the kept tokens
    output: list[Logprob] = field(default_factory=list)
    prompt_sent: bool = False


class LogprobRecorder:
    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}  # request id -> its values so far
        self._ids: dict[int, str] = {}  # seq id -> request id, for the requests recorded

    def _record(self, req: Request) -> _Record | None:
        p = req.params
        if p.logprobs is None and p.prompt_logprobs is None:
            return None
        if req.request_id not in self._records:
            prompt = [None] * len(req.prompt_token_ids) if p.prompt_logprobs is not None else None
            self._records[req.request_id] = _Record(req.seq_id, p.logprobs is not None, prompt)
            self._ids[req.seq_id] = req.request_id
        return self._records[req.request_id]

    def ask(self, msg: TargetStep, batch: ScheduledBatch) -> TargetStep:
        """Mark the prefill chunks whose prompt logprobs are still missing (the message goes out unchanged else)."""
        for chunk, seq in zip(batch.prefills, msg.prefills, strict=True):
            rec, req = self._record(chunk.req), chunk.req
            prompt_len = len(req.prompt_token_ids)
            if rec is None or rec.prompt is None or chunk.start >= prompt_len - 1:
                continue
            seq.prompt_logprobs = req.params.prompt_logprobs
            seq.next_token = req.prompt_token_ids[chunk.end] if chunk.end < prompt_len else -1
        for req in batch.rounds:
            self._record(req)
        return msg

    def took(self, out: TargetStepOutput, batch: ScheduledBatch) -> TargetStepOutput:
        """Keep the step's values until the deltas say which tokens were kept."""
        starts = {c.req.seq_id: (c.start, c.req) for c in batch.prefills}
        for seq_id, tl in out.prompt_logprobs.items():
            start, req = starts[seq_id]
            prompt = self._records[req.request_id].prompt
            targets = req.prompt_token_ids[start + 1: start + 1 + len(tl.logprobs)]
            for pos, lp in enumerate(to_logprobs(tl, targets), start + 1):
                if prompt is not None and prompt[pos] is None:  # a chunk re-run after a preemption: kept as it was
                    prompt[pos] = lp
        for seq_id, tl in out.logprobs.items():
            rid = self._ids.get(seq_id)
            if rid is not None:
                self._records[rid].pending = tl
        return out

    def attach(self, deltas: list[RequestDelta], outputs: list[RequestOutput]) -> list[RequestDelta]:
        """Give each delta its tokens' values (and the prompt's, once) and each finished output all of them;
        finished requests are forgotten."""
        done: dict[str, _Record] = {}
        for d in deltas:
            rec = self._records.get(d.request_id)
            if rec is None:
                continue
            if rec.want_output:
                d.logprobs = to_logprobs(rec.pending, d.new_token_ids) if rec.pending is not None else []
                rec.output += d.logprobs
            rec.pending = None
            if rec.prompt is not None and not rec.prompt_sent and (d.new_token_ids or d.finished):
                d.prompt_logprobs, rec.prompt_sent = list(rec.prompt), True
            if d.finished:
                done[d.request_id] = self._records.pop(d.request_id)
                self._ids.pop(rec.seq_id, None)
        for o in outputs:
            rec = done.get(o.request_id)
            if rec is not None:
                o.logprobs = rec.output if rec.want_output else None
                o.prompt_logprobs = rec.prompt
        return deltas
