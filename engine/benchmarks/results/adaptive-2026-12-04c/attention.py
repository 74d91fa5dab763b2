"""One layer's attention (SDPA, float32, one thread) at the built-in target's shape (16 query heads of 32, 350 keys)
over 32 sequences: one call with every sequence's queries padded to the longest, against the same rounds grouped
by their query count, and the cost of splitting a call. Medians of 40 calls, twice. From the repository root:

    python engine/benchmarks/results/adaptive-2026-12-04c/attention.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
H, D, L = 16, 32, 350


def median_ms(groups: list[tuple[int, int]], reps: int = 40) -> float:
    """groups: (sequences, queries) of each call; every call attends its own [b, H, q, L] with a mask."""
    args = [(torch.randn(b, H, q, D), torch.randn(b, H, L, D), torch.randn(b, H, L, D), torch.zeros(b, 1, q, L))
            for b, q in groups]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for q, k, v, m in args:
            F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1000


for _ in range(2):
    print(f"depths 4, 5, 6 (11, 11, 10 rounds) padded, 32 x 7: {median_ms([(32, 7)]):.2f} ms | grouped 11 x 7, 11 x 6, "
          f"10 x 5: {median_ms([(11, 7), (11, 6), (10, 5)]):.2f} ms | all at 5, 32 x 6: {median_ms([(32, 6)]):.2f} ms")
    print(f"split: 32 x 6 in one call {median_ms([(32, 6)]):.2f} ms, in 8 calls of 4 {median_ms([(4, 6)] * 8):.2f} ms,"
          f" in 4 of 8 {median_ms([(8, 6)] * 4):.2f} ms; plain 32 x 1 {median_ms([(32, 1)]):.2f} ms")
