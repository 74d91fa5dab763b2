"""Random streams keyed by (request seed, prefix length), never by history.

A draw at a given point of a request depends only on the seed and how many tokens precede it: not on which
rounds came before, how they were batched, or which worker process made them. So a pre-drafted tree is the
tree a re-draft would propose (pipelining), and a request re-prefilled on a restarted worker continues exactly
the stream it had (engine/execution/recovery.py): seeded outputs are identical with or without a worker fault.
"""

from __future__ import annotations

import torch

from workers.messages import SamplingSpec

_MASK64 = (1 << 64) - 1
TARGET_SALT = 0  # the verifier's streams; the draft's use WorkerConfig.draft_seed_salt, so no draw is shared


def stream_seed(seed: int, salt: int, prefix_len: int) -> int:
    """A 64-bit seed per (request, prefix length): splitmix64 of the pair, so nearby inputs differ widely."""
    z = ((seed ^ salt) * 0x9E3779B97F4A7C15 + prefix_len) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


def stream(spec: SamplingSpec, salt: int, prefix_len: int, device: torch.device) -> torch.Generator | None:
    """The generator for draws made after ``prefix_len`` tokens; None for unseeded or greedy requests."""
    if spec.greedy or spec.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(stream_seed(spec.seed, salt, prefix_len))
    return gen
