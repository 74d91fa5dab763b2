"""Sampling transforms and draws shared by the draft and the target.

The lossless invariant (docs/architecture.md) needs p and q to be the distributions tokens are *actually* drawn from, so
both sides go through the same two functions here:

- `logits_to_probs`: logits -> probabilities after every transform, in one fixed order (vLLM v1's):
  temperature, then min-p, then top-k, then top-p.
    * temperature: logits / T. T < GREEDY_TEMPERATURE (in practice T == 0) is greedy: a one-hot row at the
      argmax of the raw logits (ties: lowest index, as torch.argmax).
    * min-p: keep tokens with prob >= min_p * max prob (probs after temperature).
    * top-k: keep tokens whose logit is >= the k-th largest logit (ties at the k-th value are all kept, so
      the result never depends on sort order). k <= 0 or k >= vocab is off.
    * top-p: on the distribution left after min-p and top-k, keep the smallest prefix of the tokens sorted by
      probability whose mass reaches top_p, plus any token tied with the last one kept. top_p >= 1 is off.
  Every step is row-local (sort, cumsum, softmax along the vocab), so a row gives the same bits alone or in
  any batch: batching must not change what a request samples.
- `sample` / `sample_with_uniforms`: inverse-CDF draws, one uniform per row. One uniform per draw keeps the
  randomness a seeded request consumes independent of the vocabulary and of whoever shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scheduler.sampling_params import GREEDY_TEMPERATURE  # the one greedy predicate: T < GREEDY_TEMPERATURE


@dataclass
class SamplingBatch:
    """Per-row sampling parameters (one row per position to sample, not per request)."""

    temperature: torch.Tensor  # [N] float32; 0 means greedy
    top_k: torch.Tensor  # [N] long; -1 (or <= 0, or >= vocab) means off
    top_p: torch.Tensor  # [N] float32 in (0, 1]; 1 means off
    min_p: torch.Tensor  # [N] float32 in [0, 1]; 0 means off

    def __post_init__(self) -> None:
        n = self.temperature.shape
        for name in ("top_k", "top_p", "min_p"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape != n:
                raise ValueError(f"SamplingBatch.{name} has shape {tuple(t.shape)}, expected {tuple(n)}")

    @staticmethod
    def from_lists(
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        device: torch.device | str | None = None,
    ) -> SamplingBatch:
        if not len(temperature) == len(top_k) == len(top_p) == len(min_p):
            raise ValueError(
                "sampling lists differ in length: "
                f"temperature={len(temperature)} top_k={len(top_k)} top_p={len(top_p)} min_p={len(min_p)}"
            )
        # Values are checked here, on Python floats, so the tensor path never has to sync to validate.
        for t in temperature:
            if not t >= 0:
                raise ValueError(f"temperature must be >= 0, got {t}")
        for p in top_p:
            if not 0 < p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {p}")
        for m in min_p:
            if not 0 <= m <= 1:
                raise ValueError(f"min_p must be in [0, 1], got {m}")
        return SamplingBatch(
            temperature=torch.tensor(list(temperature), dtype=torch.float32, device=device),
            top_k=torch.tensor(list(top_k), dtype=torch.long, device=device),
            top_p=torch.tensor(list(top_p), dtype=torch.float32, device=device),
            min_p=torch.tensor(list(min_p), dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def repeat_rows(self, counts: Sequence[int]) -> SamplingBatch:
        """Row i repeated counts[i] times: a request verifies many positions (tree nodes) per round."""
        if len(counts) != len(self):
            raise ValueError(f"repeat_rows got {len(counts)} counts for {len(self)} rows")
        reps = torch.tensor(list(counts), dtype=torch.long, device=self.temperature.device)
        return SamplingBatch(
            temperature=self.temperature.repeat_interleave(reps),
            top_k=self.top_k.repeat_interleave(reps),
            top_p=self.top_p.repeat_interleave(reps),
            min_p=self.min_p.repeat_interleave(reps),
        )

    def to(self, device: torch.device | str) -> SamplingBatch:
        return SamplingBatch(
            self.temperature.to(device), self.top_k.to(device), self.top_p.to(device), self.min_p.to(device)
        )

    @property
    def is_greedy(self) -> torch.Tensor:  # [N] bool
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def all_greedy(self) -> bool:
        return bool(self.is_greedy.all())


def _sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """[M, V] -> [M, V] each row's values sorted descending (values only).

    Sorted values do not depend on the algorithm (tied entries are equal, so any order of them gives the same
    row; only +0.0 / -0.0 may swap, which no later step can tell apart), so on CPU numpy's sort serves: it is
    tens of times faster here than torch's CPU sort, which was most of a sampled round's cost.
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(np.sort(x.detach().numpy(), axis=-1)[:, ::-1]))
    return x.sort(dim=-1, descending=True).values


def logits_to_probs(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, min-p, top-k, top-p (module doc).

    Each transform runs once over all the rows that need it (neutral ones skip it, and the vocabulary is
    sorted only for rows with top-k or top-p on); every step is row-local, so a row gets the same bits whatever
    else is in the batch and whichever steps the batch had to run (tests/test_sampling_fast.py checks this
    against the plain one-pass form).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(params)} sampling rows")
    n, vocab = logits.shape
    dev = logits.device
    logits = logits.float()
    # One host read of the per-row switches (tensor comparisons, so float32 rounding decides as before).
    greedy = params.is_greedy.tolist()
    rows = [i for i, g in enumerate(greedy) if not g]  # rows that sample
    out = torch.zeros(n, vocab, device=dev) if len(rows) < n else None  # [N, V]
    if out is not None:
        hot = [i for i, g in enumerate(greedy) if g]
        hot_idx = torch.tensor(hot, dtype=torch.long, device=dev)
        out.index_put_((hot_idx, logits.index_select(0, hot_idx).argmax(dim=-1)), torch.ones(len(hot), device=dev))
    if not rows:
        return out  # type: ignore[return-value]
    if out is not None:  # only the sampling rows go through the transforms
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        params = SamplingBatch(params.temperature.index_select(0, idx), params.top_k.index_select(0, idx),
                               params.top_p.index_select(0, idx), params.min_p.index_select(0, idx))
        logits = logits.index_select(0, idx)
    x = logits / params.temperature.unsqueeze(1)  # [M, V]
    neg_inf = torch.tensor(float("-inf"), device=dev)

    # min-p, relative to the most likely token after temperature; a row with min_p = 0 keeps everything
    # (probs >= 0), so it may share the pass or skip it.
    if bool((params.min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)  # [M, V]
        floor = params.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values  # [M, 1]
        x = torch.where(probs >= floor, x, neg_inf)

    k = params.top_k
    k_on = (k > 0) & (k < vocab)  # [M]
    p_on = params.top_p < 1  # [M]; 1 is off even if float cumsum overshoots 1
    cut = (k_on | p_on).tolist()
    cut_rows = [i for i, c in enumerate(cut) if c]
    if cut_rows:
        whole = len(cut_rows) == len(cut)
        cidx = None if whole else torch.tensor(cut_rows, dtype=torch.long, device=dev)
        xs = x if cidx is None else x.index_select(0, cidx)  # [C, V]
        kc, k_onc, p_onc, top_pc = (t if cidx is None else t.index_select(0, cidx)
                                    for t in (k, k_on, p_on, params.top_p))
        sorted_x = _sorted_descending(xs)  # [C, V]
        # top-k as a threshold on the value, so ties at the k-th value are kept whatever order sort gives them.
        kth = sorted_x.gather(1, (torch.where(k_onc, kc, torch.full_like(kc, vocab)) - 1).unsqueeze(1))  # [C, 1]
        xs = torch.where(xs >= kth, xs, neg_inf)
        if bool(p_onc.any()):
            # top-p on what min-p and top-k left: a sorted token is dropped when the mass strictly before it
            # already reaches top_p. The first token always survives (mass before it is 0 < top_p).
            sorted_x = torch.where(sorted_x >= kth, sorted_x, neg_inf)  # still sorted: masking cuts a suffix
            sorted_p = torch.softmax(sorted_x, dim=-1)  # [C, V]
            before = sorted_p.cumsum(dim=-1) - sorted_p  # [C, V]
            num_keep = (before < top_pc.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)  # [C, 1]
            cutoff = sorted_x.gather(1, num_keep - 1)  # [C, 1]
            xs = torch.where(p_onc.unsqueeze(1) & (xs < cutoff), neg_inf, xs)
        x = xs if cidx is None else x.index_copy(0, cidx, xs)

    probs = torch.softmax(x, dim=-1)  # [M, V]
    if out is None:
        return probs
    return out.index_copy_(0, idx, probs)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (need not be normalised), u [...] in [0, 1) -> tokens [...] long.

    Picks the first token whose cumulative mass exceeds u * total. A zero-probability token never wins (its
    cumulative mass equals its predecessor's), and rounding at the top end is clamped to the last token with
    positive mass, so the drawn token always has probs > 0 (given any positive mass at all).
    """
    cdf = probs.float().cumsum(dim=-1)  # [..., V]
    target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)  # [...]
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device)
    last_positive = torch.where(probs > 0, positions, torch.zeros_like(positions)).amax(dim=-1)  # [...]
    return torch.minimum(idx, last_positive)


def draw_uniforms(
    generators: Sequence[torch.Generator | None], counts: Sequence[int], device: torch.device | str
) -> list[torch.Tensor]:
    """Uniforms in [0, 1): entry i gets counts[i] draws from generators[i] (None: the default RNG).

    Entries are served in order, so a generator shared by several entries (one request, several rows) hands
    them consecutive draws. Each entry draws on its generator's own device, so a seeded request's numbers
    depend only on its seed and on how many draws it made before, never on the rest of the batch.
    """
    counts = list(counts)
    if len(counts) != len(generators):
        raise ValueError(f"draw_uniforms got {len(generators)} generators and {len(counts)} counts")
    out: list[torch.Tensor] = [torch.empty(0)] * len(counts)
    # Unseeded entries share the default RNG anyway, so one launch serves all of them.
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        pooled = torch.rand(sum(counts[i] for i in unseeded), device=device)
        for i, chunk in zip(unseeded, pooled.split([counts[i] for i in unseeded]), strict=True):
            out[i] = chunk
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.rand(counts[i], generator=gen, device=gen.device).to(device)
    return out


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[N, V] probabilities -> [N] long tokens; row i draws one uniform from generators[i], in row order.

    One-hot rows return their hot index exactly (they still consume a uniform, which keeps a request's
    random stream the same whether or not some of its rows happen to be one-hot).
    """
    if probs.dim() != 2 or probs.shape[0] != len(generators):
        raise ValueError(f"probs shape {tuple(probs.shape)} does not match {len(generators)} generators")
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    u = torch.cat(draw_uniforms(generators, [1] * len(generators), probs.device))  # [N]
    return sample_with_uniforms(probs, u)
