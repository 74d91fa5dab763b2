"""Row-invariant attention in groups (workers/kernels/row_attention.py): rows whose keys are prefixes of one length
share SDPA calls only of group sizes a probe showed give every row its lone call's bits; on a kernel whose bits
change with the group, the check keeps rows invariant and trusting every size unchecked breaks them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels.row_attention import AttentionConfig, group_sizes, sdpa
from workers.row_invariant import RowAttention

HQ, HKV, D, B, L = 4, 2, 16, 24, 40
# Visible keys per sequence (one decode row each): groups of equal length, lone lengths, and a scattered row.
LENGTHS = [7] * 9 + [40] * 8 + [13, 21, 1] + [25] * 3


def _operands(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], keys / values [B, Hkv, L, D] laid out as the engine's gathered blocks (a transposed
    [B, L, Hkv, D]), mask [B, 1, 1, L]: row b sees keys [0, LENGTHS[b]), the last row every other key."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(B, L, HKV, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, 0, 0, :n] = True
    mask[-1, 0, 0] = torch.arange(L) % 2 == 0
    return q, k, v, mask


def _rows_differing_from_alone(config: AttentionConfig, kernel=sdpa, dtype: torch.dtype = torch.float32) -> list[int]:
    """Rows whose output inside the whole batch differs from the same row computed alone (a one-sequence batch)."""
    q, k, v, mask = _operands(dtype)
    together = RowAttention(list(range(B)), 1, L, mask, False, config, kernel)(q, k, v, 0.25)  # [B, Hq, D]
    differ = []
    for b in range(B):
        alone = RowAttention([0], 1, L, mask[b:b + 1], False, config, kernel)(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                                              0.25)
        if not torch.equal(together[b:b + 1], alone):
            differ.append(b)
    return differ


def _group_dependent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A kernel whose bits change with the group: a lone row through SDPA, a group through explicit matmuls and a
    softmax (another summation order), as a kernel that picked its blocking from the batch size would."""
    if q.shape[0] == 1:
        return sdpa(q, k, v, scale)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))  # [G, Hq, n, D]
    return F.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v  # [G, Hq, 1, D]


def test_grouped_rows_equal_their_lone_calls_float32_and_bfloat16() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert _rows_differing_from_alone(AttentionConfig(), dtype=dtype) == []


def test_grouped_rows_match_masked_attention() -> None:
    """Grouping loses no row and mixes none up: close to one masked SDPA call over the whole batch."""
    q, k, v, mask = _operands()
    got = RowAttention(list(range(B)), 1, L, mask, False)(q, k, v, 0.25)  # [B, Hq, D]
    want = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want[:, :, 0], rtol=1e-5, atol=1e-5)


def test_the_check_keeps_rows_invariant_on_a_kernel_that_is_not() -> None:
    config = AttentionConfig(max_group=16, probe_lengths=(7, 40))
    assert group_sizes(torch.zeros(1, HQ, D), torch.zeros(1, HKV, 1, D), _group_dependent, config) == (1,)
    assert _rows_differing_from_alone(config, _group_dependent) == []


def test_bypassing_the_check_on_that_kernel_breaks_row_invariance() -> None:
    config = AttentionConfig(max_group=16, probe_lengths=(7, 40), check_groups=False)
    assert _rows_differing_from_alone(config, _group_dependent) != []


def test_a_kernel_that_differs_only_at_long_keys_is_caught_by_the_probe_lengths() -> None:
    """The probe checks each size at every listed key length: a kernel whose group order changes past 512 keys
    is refused when the lengths reach there, and admitted (wrongly) when they stop short."""
    def long_keys_differ(q, k, v, scale):
        return _group_dependent(q, k, v, scale) if k.shape[2] > 512 else sdpa(q, k, v, scale)

    q, k = torch.zeros(1, HQ, D), torch.zeros(1, HKV, 1, D)
    assert group_sizes(q, k, long_keys_differ, AttentionConfig(max_group=8, probe_lengths=(7, 513))) == (1,)
    assert group_sizes(q, k, long_keys_differ, AttentionConfig(max_group=8, probe_lengths=(7, 40)))[0] == 8
