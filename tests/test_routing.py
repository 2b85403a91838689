"""The MoE routing kernels (kernels/routing.py) against torch's stable sort and
a direct loop, on sizes that span several scan blocks (1024 slots per step)."""

from __future__ import annotations

import time

import torch

from overlap_kernels.kernels.routing import stable_order, token_rows


def test_stable_order_matches_a_stable_sort():
    torch.manual_seed(time.time_ns() % 2**31)
    for num_slots, num_keys in ((0, 3), (1, 1), (2500, 9), (3000, 2)):
        keys = torch.randint(0, num_keys, (num_slots,))
        order, counts = stable_order(keys, num_keys)
        assert torch.equal(order, torch.argsort(keys, stable=True))
        assert torch.equal(counts.long(), torch.bincount(keys, minlength=num_keys))


def test_token_rows_lists_each_token_once_per_rank_in_order():
    torch.manual_seed(time.time_ns() % 2**31)
    for t, k, world, per_rank in ((0, 2, 2, 2), (1, 1, 1, 3), (700, 3, 3, 2), (300, 8, 4, 1)):
        num_experts = world * per_rank
        keys = torch.randint(0, num_experts + 1, (t, k))  # num_experts: an unused slot
        row_in_block, tokens, counts = token_rows(keys, world, per_rank)
        for d in range(world):
            sends = ((keys >= d * per_rank) & (keys < (d + 1) * per_rank)).any(1)
            expected = sends.nonzero().squeeze(1)
            assert int(counts[d]) == expected.numel()
            assert torch.equal(tokens[d, : expected.numel()], expected)
            rows = torch.full((t,), -1, dtype=torch.int64)
            rows[expected] = torch.arange(expected.numel())
            assert torch.equal(row_in_block[:, d], rows)
