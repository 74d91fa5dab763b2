"""One layer's paged attention at batch 32 (the built-in target's heads: 16 query, 8 KV, dim 32; contexts 100-460
tokens, random), each sequence verifying a chain of the given query counts: one padded call against the rounds
grouped by query count (``workers.input_batch.attention_groups``, at ``GROUP_CALL_PAIRS`` 4096 and 0). Best of 7
runs of 10 calls each, one torch thread; the one-call layout timed before and after the grouped ones.

    OMP_NUM_THREADS=1 python engine/benchmarks/results/adaptive-2026-12-04f/attention_groups.py
"""

import random
import time

import torch

from workers import input_batch
from workers.attention import PagedContext
from workers.input_batch import SeqForward, build_batch
from workers.kv_cache import KVCache

torch.set_num_threads(1)
BS, HQ, HKV, D = 16, 16, 8, 32


def batch(queries: list[int], ctx: list[int]) -> tuple[list[SeqForward], int]:
    seqs, nb = [], 0
    for q, n in zip(queries, ctx, strict=True):
        blocks = list(range(nb, nb + -(-(n + q) // BS)))
        nb += len(blocks)
        seqs.append(SeqForward(blocks, n, [-1] + list(range(q - 1)), list(range(q))))
    return seqs, nb


def best_ms(queries: list[int], ctx: list[int], pairs: int) -> tuple[float, int]:
    input_batch.GROUP_CALL_PAIRS = pairs
    seqs, nb = batch(queries, ctx)
    b = build_batch(seqs, BS)
    cache = KVCache(1, nb + 1, BS, HKV, D)
    t = b.input_ids.shape[0]
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    attn = PagedContext(b.meta, cache)
    for _ in range(3):
        attn.attend(0, q, k, v)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            attn.attend(0, q, k, v)
        best = min(best, (time.perf_counter() - t0) / 10 * 1e3)
    return best, len(b.meta.groups)


rng = random.Random(0)
ctx = [rng.randint(100, 460) for _ in range(32)]
cases = {"32 x 5": [5] * 32, "9 + 31 x 5": [9] + [5] * 31, "3/5": [3, 5] * 16, "4/6": [4, 6] * 16,
         "31 x 1 + 5": [1] * 31 + [5], "2/6": [2, 6] * 16, "1..9": [1 + i % 9 for i in range(32)],
         "32 x 1": [1] * 32, "28 x 1 + 4 x 9": [1] * 28 + [9] * 4}
print("case            one call (before, after)  grouped at 4096 pairs   grouped at 0 (every count apart)")
for name, queries in cases.items():
    one, _ = best_ms(queries, ctx, 10**12)
    g4, n4 = best_ms(queries, ctx, 4096)
    g0, n0 = best_ms(queries, ctx, 0)
    one2, _ = best_ms(queries, ctx, 10**12)
    print(f"{name:15s} {one:6.2f} {one2:6.2f} ms          {g4:6.2f} ms ({n4} groups)      {g0:6.2f} ms ({n0} groups)")
