"""Which row counts a matmul kernel may be called with so that a row's bits never depend on the call: checked.

A BLAS / oneDNN kernel picks its algorithm and blocking from the shape, so a row summed inside an M-row call may
differ in its last bits from the same row inside an M'-row call. The one shape we trust without asking is the
base chunk (``KernelConfig.gemm_rows`` rows, zero-padded): one shape is one kernel. Other row counts are admitted
only after a probe shows they give every row exactly the base chunk's bits; calls are then cut into admitted sizes
(the last one zero-padded up to the next admitted size), so only verified shapes are ever called.

The probe, once per (kernel, weight shape, dtype, thread count) on first use, for every row count of ``candidates``,
runs the kernel on a probe weight of the same shape and probe rows built so that the sum of a row is as sensitive to
its summation order as it can be: half of each row is pairs of large terms (x up to 2^12) that cancel exactly in
exact arithmetic, the rest small terms, so the result is the small terms' sum and which of them a large partial sum
absorbs depends on the order. Random data is not enough: MKL's bfloat16 GEMM at [576 x 1,536] sums a lone row (M =
1) in another order than the base chunk, and bfloat16 rounding hides it on random rows (3 of 36,864 outputs
differed) where these rows show it (30,026); a random probe admitted M = 1 and tests/test_row_invariance.py failed.
The probe rows through base chunks are the reference (checked once against the same rows shifted by three places, so
the base chunk itself is shown to ignore a row's position and neighbours); a candidate size s is admitted when the
first s probe rows in one s-row call equal the reference bit for bit, every position of the call included. Why a
probe is enough: the kernels choose their code path from the shape, layout, dtype and thread count, never from the
values (the key holds all four), and only verified shapes are called; a kernel that branched on values (denormals,
NaNs) would escape it. Found here (torch 2.13, AVX-512, 1 and 2 threads): oneDNN float32 admits every count for the
shipped shapes but M = 1 at K = 1,536; MKL float32 all but 1-3 at one thread (1-3, 5-7, 9-11 at two); MKL bfloat16
all but M = 1 at K = 1,536. The probe costs ~0.01-0.1 s per shape, 1.4 s for SmolLM2's 49,152 x 576
head.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

import torch


class ChunkConfig(Protocol):
    """The fields of ``workers.kernels.row_linear.KernelConfig`` the check reads (what each trades: there)."""

    gemm_rows: int
    max_rows: int
    check_sizes: bool

Kernel = Callable[[torch.Tensor], torch.Tensor]  # chunk [s, K] -> [s, N]
KernelOf = Callable[[torch.Tensor], Kernel]  # weight [N, K] -> its kernel
_PROBE_SHIFT = 3  # rows the base check moves the probe by (not a multiple of any sensible chunk size)


@dataclass
class SizeVerdicts:
    """What one (kernel, shape, dtype, threads)'s probe showed."""

    admitted: dict[int, bool]  # candidate row count -> gives the base's bits
    plans: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rows m -> call sizes covering them


_VERDICTS: dict[Hashable, SizeVerdicts] = {}


def chunked_call(x: torch.Tensor, weight: torch.Tensor, kernel_of: KernelOf, key: Hashable,
                 config: ChunkConfig) -> torch.Tensor:
    """x [T, K] -> kernel_of(weight)(x) [T, N], the kernel only ever called on row counts verified for ``key``
    (see the module doc), each call on a fresh zero-padded copy of its rows (so the operand's alignment is fixed
    too)."""
    t, k = x.shape
    full_key = (key, tuple(weight.shape), x.dtype, x.device.type, torch.get_num_threads(), config.gemm_rows,
                config.max_rows, config.check_sizes)
    verdicts = _verdicts(kernel_of, full_key, tuple(weight.shape), x.dtype, x.device, config)
    kernel = kernel_of(weight)
    parts = []
    start = 0
    while start < t:
        m = min(t - start, config.max_rows)
        for size in _plan(verdicts, m, config):
            take = min(size, t - start)
            chunk = x.new_zeros(size, k)  # [size, K]
            chunk[:take] = x[start:start + take]
            parts.append(kernel(chunk)[:take])
            start += take
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, N]


def admitted_sizes(key: Hashable, shape: tuple[int, int], dtype: torch.dtype, config: ChunkConfig,
                   device: str = "cpu") -> list[int]:
    """The row counts probed so far and admitted for ``key`` at this thread count (for reports and tests)."""
    v = _VERDICTS.get((key, shape, dtype, device, torch.get_num_threads(), config.gemm_rows, config.max_rows,
                       config.check_sizes))
    return [] if v is None else sorted(s for s, ok in v.admitted.items() if ok)


def probe_operands(n: int, k: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe weight [N, K] and rows [rows, K] whose products sum order-sensitively (the module doc): columns
    [0, h) and [h, 2h) hold large terms that cancel pairwise (x equal, w opposite), the rest small ones."""
    g = torch.Generator().manual_seed(0)
    h = k // 4
    w = torch.randn(n, k, generator=g)
    w[:, h:2 * h] = -w[:, :h]
    big = torch.randint(0, 2, (rows, h), generator=g) * 2 - 1  # [rows, h] signs
    big = big * torch.pow(2.0, torch.randint(4, 13, (rows, h), generator=g).float())
    x = torch.randn(rows, k, generator=g) * 2.0**-6
    x[:, :h], x[:, h:2 * h] = big, big
    return w.to(dtype), x.to(dtype)


def _verdicts(kernel_of: KernelOf, full_key: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device, config: ChunkConfig) -> SizeVerdicts:
    found = _VERDICTS.get(full_key)
    if found is not None:
        return found
    if not config.check_sizes:
        return _VERDICTS.setdefault(full_key, SizeVerdicts({}))
    base, rows = config.gemm_rows, config.max_rows
    w, probe = probe_operands(shape[0], shape[1], rows, dtype)
    w, probe = w.to(device), probe.to(device)
    kernel = kernel_of(w)

    def through_base(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernel(p[i:i + base].clone()) for i in range(0, rows, base)])  # [max_rows, N]

    reference = through_base(probe)
    if not torch.equal(through_base(probe.roll(_PROBE_SHIFT, 0)), reference.roll(_PROBE_SHIFT, 0)):
        raise RuntimeError(f"this kernel is not row-invariant even at a fixed shape ({base} rows, {shape}, "
                           f"{dtype}, {torch.get_num_threads()} threads): a row's bits depend on its neighbours "
                           "or its place in the call")
    admitted = {s: s == base or torch.equal(kernel(probe[:s].clone()), reference[:s]) for s in candidates(config)}
    verdicts = SizeVerdicts(admitted)  # the probe weight and rows go: the head's is as big as the head
    _VERDICTS[full_key] = verdicts
    return verdicts


def candidates(config: ChunkConfig) -> list[int]:
    """The row counts probed: every count up to 2 base chunks, then whole base chunks up to ``max_rows`` (a call
    of other sizes is padded to the next one: at most 1.5x the rows beyond 2 chunks, no probe per count)."""
    base = config.gemm_rows
    return sorted(set(range(1, 2 * base + 1)) | set(range(base, config.max_rows + 1, base)))


def _plan(verdicts: SizeVerdicts, m: int, config: ChunkConfig) -> tuple[int, ...]:
    """Call sizes for m <= max_rows rows: the smallest admitted size >= m and below 2m (zero-padded; the base always
    is one when m < base), else base chunks."""
    plan = verdicts.plans.get(m)
    if plan is not None:
        return plan
    if not config.check_sizes:
        plan = (m,)  # trusted without a probe: only for showing what the check prevents
    else:
        top = min(config.max_rows, max(config.gemm_rows, 2 * m - 1))
        up = next((s for s in range(m, top + 1) if verdicts.admitted.get(s)), None)
        plan = (up,) if up is not None else (config.gemm_rows,) * -(-m // config.gemm_rows)
    verdicts.plans[m] = plan
    return plan
