"""Log-probabilities of emitted and prompt tokens, from logits the target's forward already computed.

Which row scores which token: in a verified round (workers/target_worker.py ``_verify_piece``) row 0 is the law
of the root's children and row i + 1 the law after node i, so the round's k-th emitted token (accepted, then
the one recovered or bonus token) was drawn at row 0 for k = 0 and at row ``accepted_nodes[k - 1] + 1`` after
that. A recovered token is drawn from a residual, but its logprob is the target's (vLLM reports the same: the
residual is how the law is sampled, not the law).

Modes (vLLM's ``logprobs_mode`` names): ``raw_logprobs`` log_softmax of the model's logits (the default; defined
at temperature 0 too), ``raw_logits`` the logits themselves, ``processed_logprobs`` the log of the law after the
request's temperature, top-k, top-p and min-p (a token those cut has -inf; a greedy request has no transform,
so it gets the raw values). Every computation is row-local, so a row's values do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.messages import PrefillSeq, SamplingSpec, TokenLogprobs, VerifyResult, VerifySeq
from workers.sampling import logits_to_probs
from workers.worker_base import sampling_batch


def emitted_rows(result: VerifyResult) -> list[int]:
    """The logits row (0 = the root) each of a round's emitted tokens was drawn at, in emitted order."""
    return [0] + [a + 1 for a in result.accepted_nodes]


def _values(rows: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[T, V] logits -> [T, V] float32 values of the spec's mode."""
    x = rows.float()
    if spec.logprobs_mode == "raw_logits":
        return x
    if spec.logprobs_mode == "processed_logprobs" and not spec.greedy:
        probs = logits_to_probs(x, sampling_batch([spec], [x.shape[0]], x.device))  # [T, V]
        return probs.log()
    return torch.log_softmax(x, dim=-1)


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], spec: SamplingSpec, k: int) -> TokenLogprobs:
    """rows [T, V] logits, tokens [T]: each token's value at its row and the row's k largest (ids, values)."""
    vals = _values(rows, spec)  # [T, V]
    idx = torch.tensor(list(tokens), dtype=torch.long, device=vals.device).unsqueeze(1)  # [T, 1]
    own = vals.gather(1, idx).squeeze(1)  # [T]
    if k > 0:
        top = vals.topk(min(k, vals.shape[1]), dim=-1)  # [T, k]
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_vals = [[] for _ in tokens], [[] for _ in tokens]
    return TokenLogprobs(own.tolist(), top_ids, top_vals)


def round_logprobs(rows: torch.Tensor, result: VerifyResult, spec: SamplingSpec) -> TokenLogprobs:
    """rows [N + 1, V]: one verified round's logits; the logprobs of the tokens it emitted."""
    index = torch.tensor(emitted_rows(result), dtype=torch.long, device=rows.device)
    return token_logprobs(rows.index_select(0, index), result.tokens, spec, spec.logprobs)


def prompt_targets(token_ids: Sequence[int], next_token: int) -> list[int]:
    """The tokens a prefill chunk's rows score: row j scores the prompt token after position j (the chunk's
    next one, then ``next_token`` after its last row; none there when the chunk ends the prompt)."""
    return list(token_ids[1:]) + ([next_token] if next_token >= 0 else [])


def prefill_logit_nodes(p: PrefillSeq) -> list[int]:
    """The chunk's rows the forward must score: all of them for prompt logprobs, else the last when it samples."""
    n = len(p.token_ids)
    return list(range(n)) if p.prompt_logprobs >= 0 else [n - 1] if p.sample is not None else []


def prefill_logprobs(prefills: Sequence[PrefillSeq], logits: torch.Tensor,
                     first_tokens: dict[int, int]) -> tuple[dict[int, TokenLogprobs], dict[int, TokenLogprobs]]:
    """logits [sum of prefill_logit_nodes, V] in chunk order -> (first tokens' logprobs, prompt logprobs), by seq id.

    Prompt logprobs are always raw (vLLM's prompt logprobs are too): no sampling transform applies to a prompt.
    """
    first: dict[int, TokenLogprobs] = {}
    prompt: dict[int, TokenLogprobs] = {}
    row = 0
    for p in prefills:
        n = len(prefill_logit_nodes(p))
        rows = logits[row: row + n]  # [n, V]
        row += n
        if p.prompt_logprobs >= 0:
            targets = prompt_targets(p.token_ids, p.next_token)
            if targets:
                raw = SamplingSpec(1.0, -1, 1.0, 0.0, None)
                prompt[p.seq_id] = token_logprobs(rows[: len(targets)], targets, raw, p.prompt_logprobs)
        spec = p.sample
        if spec is not None and spec.logprobs >= 0 and p.seq_id in first_tokens:
            first[p.seq_id] = token_logprobs(rows[n - 1:], [first_tokens[p.seq_id]], spec, spec.logprobs)
    return first, prompt


def verify_logprobs(seqs: Sequence[VerifySeq], logits: torch.Tensor,
                    results: Sequence[VerifyResult]) -> dict[int, TokenLogprobs]:
    """logits [sum(N_i + 1), V] of the verified rounds -> the emitted tokens' logprobs of rounds that ask."""
    out: dict[int, TokenLogprobs] = {}
    row = 0
    for s, res in zip(seqs, results, strict=True):
        n = len(s.tree_tokens) + 1
        if s.sampling.logprobs >= 0 and res.tokens:
            out[s.seq_id] = round_logprobs(logits[row: row + n], res, s.sampling)
        row += n
    return out
