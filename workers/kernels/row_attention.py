"""Several query rows in one SDPA call, each row still getting exactly the bits of its own one-row call: checked.

Row-invariant attention (workers/row_invariant.py ``RowAttention``) gives each query row its own one-query SDPA
call over exactly the keys it may see: at a decode step of 64 sequences that is 64 calls per layer, each paying
the dispatcher and SDPA's set-up for a [1, H, 1, D] x [1, H, n, D] product (most of the per-row price at batch).
Rows whose visible keys are a prefix [0, n) of the same length n can share one call: q [G, Hq, 1, D] against the
G rows' keys [G, Hkv, n, D]. A batched call gives each row the bits of its lone call only if the kernel computes
every (row, head) alone, in an order that depends on n and not on G; torch's CPU flash kernel does (it parallelises
over batch x heads and sums each one's keys in blocks fixed by n), but that is a fact about one kernel build, so it
is probed, as the linear layers' row counts are (workers/kernels/row_chunks.py).

The probe, once per (kernel, Hq, Hkv, D, dtype, device, thread count) on first use: for every key length of
``AttentionConfig.probe_lengths`` (short ones, each side of the 16-wide vector tails and of the 512-key blocks),
``max_group`` probe rows are computed one call each (the reference) and then in one call per candidate group size,
with the keys laid out as the engine lays them (a slice of consecutive sequences and a gather of scattered ones),
and a size is admitted when every row of every length equals its reference bit for bit. The probe rows are built
order-sensitively: keys come in equal pairs whose values are large and opposite (they cancel exactly in exact
arithmetic, so which small terms a large partial sum absorbs shows the order). A group is then cut into admitted
sizes, largest first (1 always is: the lone call is the definition). What it does not cover: key lengths between
the probed ones are trusted by the kernel's structure (its order changes only at vector and block boundaries,
each probed on both sides), not checked one by one; a kernel that branched on values would escape it too.

Found here (torch 2.13 CPU, AVX-512, float32 and bfloat16, 1 and 2 threads, the built-in pair's and SmolLM2's head
shapes): every group size admitted.

The native op (``native_attention``, row_attention.cpp, built into the GGUF kernel's library) replaces all of that
for float32 rows on a CPU: one call per layer for every query row of a forward (decode rows of many sequences,
chain rows, tree rows, prompt rows), each (row, head) computed alone in one fixed order over exactly its visible
keys, read from the paged cache by slot: row-invariant by construction, so nothing to probe. Whether a row takes
it depends only on the model (float32, CPU) and the library being here (``native_here``), never on the batch.
The SDPA calls above stay for bfloat16, GPUs, and where the library does not build.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# (q [G, Hq, 1, D], keys [G, Hkv, n, D], values [G, Hkv, n, D], scale) -> [G, Hq, 1, D]
Sdpa = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The kernel the engine uses: torch's SDPA, GQA by ``enable_gqa`` (query head h reads kv head h // (Hq/Hkv))."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class AttentionConfig:
    # Most rows in one SDPA call. Larger: fewer calls at big batches, more group sizes to probe on first use.
    max_group: int = 64
    # Call only group sizes the probe admitted. False trusts every size unchecked: only for showing what the
    # check prevents (tests/test_attention_groups.py).
    check_groups: bool = True
    # Key lengths the probe checks each group size at: the short ones, both sides of the 16-wide vector tails and
    # of the CPU kernel's 512-key blocks. More: a longer probe (~G calls per length), fewer lengths trusted.
    probe_lengths: tuple[int, ...] = (1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 255, 512, 513, 700)

    def __post_init__(self) -> None:
        if self.max_group < 1 or not self.probe_lengths or min(self.probe_lengths) < 1:
            raise ValueError(f"max_group must be >= 1 and probe_lengths positive, got {self.max_group}, "
                             f"{self.probe_lengths}")


DEFAULT_ATTENTION = AttentionConfig()
_ADMITTED: dict[Hashable, tuple[int, ...]] = {}  # probe key -> admitted group sizes, largest first


def group_keys(keys: torch.Tensor, seqs: list[int], seq_index: torch.Tensor, n: int) -> torch.Tensor:
    """keys [B, Hkv, L, D] -> the listed sequences' first n keys [G, Hkv, n, D], laid out per row exactly as a
    one-row call's view ``keys[b:b+1, :, :n]`` (same strides inside a row): a slice when the sequences are
    consecutive, else a gather over the sequence dimension of the [B, L, Hkv, D] storage."""
    if seqs == list(range(seqs[0], seqs[0] + len(seqs))):
        return keys[seqs[0]:seqs[0] + len(seqs), :, :n]  # a view
    return keys[:, :, :n].transpose(1, 2).index_select(0, seq_index).transpose(1, 2)  # [G, Hkv, n, D]


def group_sizes(q: torch.Tensor, keys: torch.Tensor, kernel: Sdpa = sdpa,
                config: AttentionConfig = DEFAULT_ATTENTION) -> tuple[int, ...]:
    """The group sizes ``kernel`` may be called with for q [*, Hq, D] against keys [*, Hkv, *, D] (probed on first
    use; largest first, 1 always)."""
    hq, hkv, d = q.shape[1], keys.shape[1], q.shape[2]
    key = (kernel, hq, hkv, d, q.dtype, q.device.type, torch.get_num_threads(), config)
    found = _ADMITTED.get(key)
    if found is None:
        found = _probe(kernel, hq, hkv, d, q.dtype, q.device, config)
        _ADMITTED[key] = found
    return found


def cut(count: int, sizes: tuple[int, ...]) -> list[int]:
    """count rows as calls of admitted sizes (largest first; sizes holds 1, so it always ends)."""
    out = []
    for s in sizes:
        while count >= s:
            out.append(s)
            count -= s
    return out


def _candidates(config: AttentionConfig) -> list[int]:
    """Every size up to 8, then powers of two up to ``max_group`` and ``max_group`` itself."""
    top = config.max_group
    return sorted({s for s in range(2, min(8, top) + 1)} | {2**i for i in range(3, top.bit_length())} | {top} - {1})


def _probe(kernel: Sdpa, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device,
           config: AttentionConfig) -> tuple[int, ...]:
    sizes = _candidates(config)
    if not config.check_groups:
        return tuple(sorted(set(sizes) | {1}, reverse=True))
    rows = config.max_group
    admitted = set(sizes)
    g = torch.Generator().manual_seed(0)
    scale = d ** -0.5
    q, k, v = _probe_operands(rows, hq, hkv, max(config.probe_lengths), d, g)  # each length reads a prefix
    q, k, v = q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)
    for n in config.probe_lengths:
        alone = torch.cat([kernel(q[r:r + 1], k[r:r + 1, :, :n], v[r:r + 1, :, :n], scale)
                           for r in range(rows)])  # [rows, Hq, 1, D]
        order = torch.randperm(rows, generator=g).to(device)  # scattered sequences: the gather layout
        for s in sorted(admitted):
            together = kernel(q[:s], group_keys(k, list(range(s)), order, n), group_keys(v, list(range(s)), order, n),
                              scale)
            scattered = order[:s]
            gathered = kernel(q.index_select(0, scattered), group_keys(k, scattered.tolist(), scattered, n),
                              group_keys(v, scattered.tolist(), scattered, n), scale)
            if not (torch.equal(together, alone[:s]) and torch.equal(gathered, alone.index_select(0, scattered))):
                admitted.discard(s)
    return tuple(sorted(admitted | {1}, reverse=True))


def _probe_operands(rows: int, hq: int, hkv: int, n: int, d: int,
                    g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, Hq, 1, D] and keys / values [rows, Hkv, n, D] (strided as the engine's: a transposed [rows, n, Hkv,
    D]) whose weighted sums are order-sensitive: keys in equal pairs (equal weights) with large opposite values,
    plus small noise on every value."""
    q = torch.randn(rows, hq, 1, d, generator=g)
    half = (n + 1) // 2
    k = torch.randn(rows, half, hkv, d, generator=g).repeat_interleave(2, dim=1)[:, :n]  # [rows, n, Hkv, D]
    big = torch.pow(2.0, torch.randint(4, 13, (rows, half, hkv, d), generator=g).float())
    sign = torch.randint(0, 2, (rows, half, hkv, d), generator=g) * 2 - 1
    pair = torch.stack([big * sign, -big * sign], dim=2).flatten(1, 2)[:, :n]  # [rows, n, Hkv, D]
    v = pair + torch.randn(rows, n, hkv, d, generator=g) * 2.0**-6
    return q, k.contiguous().transpose(1, 2), v.contiguous().transpose(1, 2)


# --- the native op (row_attention.cpp) ---

ROW_FIELDS = 4  # a row's entry in ``rows``: (block table offset, prefix, extras offset, extras count) into ``index``


def native_here() -> bool:
    """Whether float32 CPU rows take the native op here: the GGUF kernel's library built and checked
    (workers/kernels/gguf_blocks.py), a CPU with AVX-512, and ``SPECSERVE_ROW_ATTENTION`` not "0" (read per call: a
    benchmark swaps it). A property of the machine, never of the batch; why not is said once."""
    from workers.kernels import gguf_blocks

    if os.environ.get("SPECSERVE_ROW_ATTENTION", "1") == "0":
        return False
    if not gguf_blocks.available():
        _unavailable("the GGUF kernel's library is off or did not build")
        return False
    if gguf_blocks.best_isa() not in ("avx512", "avx512vnni"):
        _unavailable("this CPU lacks AVX-512: its scalar path defines the bits but is slower than SDPA")
        return False
    return _checked()




@functools.cache
def _checked() -> bool:
    """The op checked (``self_check``) in a subprocess on this CPU before the engine calls it, once per library and
    CPU (a marker beside the library, as gguf_blocks does for its matmuls): a crash or a wrong bit there only fails
    that subprocess, and the engine keeps the SDPA path (said once)."""
    from workers.kernels import gguf_blocks

    try:
        gguf_blocks.check_in_subprocess(gguf_blocks.build(), "workers.kernels.row_attention", "attention-ok")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _unavailable(f"its check did not pass: {e}")
        return False
    return True


@functools.cache
def _unavailable(why: str) -> None:
    log.warning("native row attention unavailable (%s): float32 rows take one SDPA call per query row", why)


def native_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
                     block_size: int, scale: float, isa: str = "auto") -> torch.Tensor:
    """q [T, Hq, D] float32, k / v [slots, Hkv, D] float32 (one layer of the paged cache) -> [T, Hq, D]: each row
    over the keys ``rows`` [T, 4] int64 and ``index`` [*] int64 give it (``attention.RowKeyLayout``); ``isa``:
    "scalar" (the definition), "avx512", or "skewed" (a test-only variant whose exp-sum order depends on T)."""
    from workers.kernels.gguf_blocks import ISA

    return torch.ops.specserve_gguf.row_attention(q, k, v, rows, index, block_size, scale,
                                                  -1 if isa == "auto" else ISA[isa])


def native_isas() -> list[str]:
    """The paths the native op runs on here (the scalar one everywhere; it defines the bits)."""
    from workers.kernels.gguf_blocks import best_isa

    return ["scalar", "avx512"] if best_isa() in ("avx512", "avx512vnni") else ["scalar"]


def dense_layout(key_counts: list[int], block_size: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows``, ``index`` for T rows of one sequence whose blocks are 0, 1, 2, ... (slot = position), row i seeing
    positions [0, key_counts[i]): for checks and tests."""
    index = torch.arange(-(-num_slots // block_size))
    rows = torch.tensor([[0, n, 0, 0] for n in key_counts], dtype=torch.long).view(-1, ROW_FIELDS)
    return rows, index


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_counts: list[int],
                        scale: float) -> torch.Tensor:
    """``native_attention`` over ``dense_layout`` in float64 by torch ops: q [T, Hq, D], k / v [S, Hkv, D] ->
    [T, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    out = []
    for i, n in enumerate(key_counts):
        kk, vv = (x[:n].double().repeat_interleave(group, dim=1) for x in (k, v))  # [n, Hq, D]
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale, dim=-1)  # [Hq, n]
        out.append(torch.einsum("hn,nhd->hd", w, vv))
    return torch.stack(out)


def self_check() -> None:
    """The checks the subprocess runs before the engine calls the op (raises AssertionError): values against
    float64, a row of a call == the row alone, the paths' bits equal."""
    g = torch.Generator().manual_seed(2)
    for hq, hkv, d in ((6, 2, 8), (9, 3, 64), (4, 4, 40)):
        counts = [1, 2, 15, 16, 17, 40, 33, 5]
        k, v = (torch.randn(48, hkv, d, generator=g) for _ in range(2))  # [slots, Hkv, D]
        q = torch.randn(len(counts), hq, d, generator=g)
        rows, index = dense_layout(counts, 16, 48)
        ref = reference_attention(q, k, v, counts, d ** -0.5).float()
        base = native_attention(q, k, v, rows, index, 16, d ** -0.5, "scalar")
        for isa in native_isas():
            y = native_attention(q, k, v, rows, index, 16, d ** -0.5, isa)
            torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5, msg=f"{hq}/{hkv}x{d} {isa}: values")
            assert torch.equal(y, base), f"{hq}/{hkv}x{d} {isa}: paths differ"
            for i in range(len(counts)):
                alone = native_attention(q[i:i + 1], k, v, rows[i:i + 1], index, 16, d ** -0.5, isa)
                assert torch.equal(alone[0], y[i]), f"{hq}/{hkv}x{d} {isa}: row {i} alone differs"


def main() -> None:
    """``python -m workers.kernels.row_attention --check LIBRARY``: load it and run ``self_check`` (``_checked``)."""
    if len(sys.argv) != 3 or sys.argv[1] != "--check":
        raise SystemExit("usage: python -m workers.kernels.row_attention --check LIBRARY")
    torch.ops.load_library(sys.argv[2])
    self_check()
    print("ok")


if __name__ == "__main__":
    main()
