"""The MoE routing kernels (kernels/routing.py) against torch's stable sort and
a direct loop, on sizes that span several scan blocks (1024 slots per step)."""

from __future__ import annotations

import time

import torch

from overlap_kernels.kernels.routing import HEADER, RECORD_COLUMNS, route_pairs


def _route(topk_ids, topk_weights, world, num_experts, hidden=64, itemsize=2):
    counts = torch.full((len(HEADER) + world + num_experts,), -7, dtype=torch.int32)  # poisoned
    outputs = route_pairs(topk_ids, topk_weights, world, num_experts, counts, hidden, itemsize)
    return counts, *outputs


def test_route_pairs_orders_pairs_stably_by_expert():
    torch.manual_seed(time.time_ns() % 2**31)
    for t, k, world, per_rank, dtype in ((0, 2, 2, 2, torch.int64), (1, 1, 1, 3, torch.int32),
                                         (700, 3, 3, 2, torch.int64), (300, 8, 4, 1, torch.int32)):  # fmt: skip
        num_experts = world * per_rank
        # -1 (unused) and out-of-range ids (counted as invalid) among the experts.
        ids = torch.randint(-3, num_experts + 2, (t, k)).to(dtype)
        weights = torch.rand(t, k, dtype=torch.bfloat16)
        counts, records, pair_slots, _, _ = _route(ids, weights, world, num_experts)
        flat = ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < num_experts)
        invalid = int(((flat < -1) | (flat >= num_experts)).sum())
        assert counts[: len(HEADER)].tolist() == [invalid, t, 64, 2, num_experts, k]
        expected_counts = torch.bincount(flat[valid], minlength=num_experts)
        assert torch.equal(counts[len(HEADER) + world :].long(), expected_counts)
        keys = torch.where(valid, flat, num_experts)
        order = torch.argsort(keys, stable=True)[: int(valid.sum())]
        pairs = order.numel()
        assert torch.equal(pair_slots[:pairs], order)
        assert records.shape == (t * k, RECORD_COLUMNS)
        assert torch.equal(records[:pairs, 1].long(), order // k)
        assert torch.equal(records[:pairs, 3].long(), order % k)
        assert torch.equal(
            records[:pairs, 2].view(torch.float32), weights.reshape(-1)[order].float()
        )


def test_route_pairs_lists_each_token_once_per_rank_in_order():
    torch.manual_seed(time.time_ns() % 2**31)
    for t, k, world, per_rank in ((0, 2, 2, 2), (1, 1, 1, 3), (700, 3, 3, 2), (300, 8, 4, 1)):
        num_experts = world * per_rank
        ids = torch.randint(-1, num_experts, (t, k))
        counts, records, pair_slots, row_in_block, tokens = _route(
            ids, torch.rand(t, k), world, num_experts
        )
        for d in range(world):
            sends = ((ids >= d * per_rank) & (ids < (d + 1) * per_rank)).any(1)
            expected = sends.nonzero().squeeze(1)
            assert int(counts[len(HEADER) + d]) == expected.numel()
            assert torch.equal(tokens[d, : expected.numel()], expected)
            rows = torch.full((t,), -1, dtype=torch.int64)
            rows[expected] = torch.arange(expected.numel())
            assert torch.equal(row_in_block[:, d], rows)
        # Each pair's record holds its token's row in its destination's block.
        pairs = int(counts[len(HEADER) + world :].sum())
        dest = ids.reshape(-1)[pair_slots[:pairs]] // per_rank
        assert torch.equal(records[:pairs, 0].long(), row_in_block[pair_slots[:pairs] // k, dest])


def test_expand_runs_makes_every_table_in_one_launch():
    import numpy as np

    from overlap_kernels.kernels.runs import expand_runs

    rng = np.random.default_rng(time.time_ns() % 2**31)
    tables = []
    for runs in (0, 1, 5, 300):  # 300 runs and ~1500 rows: several programs, a padded run table
        lengths = rng.integers(0, 10, runs)
        lengths[: runs // 3] = 0  # empty runs, leading ones among them
        tables.append((lengths, rng.integers(-1000, 1000, runs), bool(runs % 2)))
    got = expand_runs(tables, torch.device("cpu"))
    for (lengths, values, count_up), out in zip(tables, got):
        expected = np.repeat(values, lengths) + (np.arange(lengths.sum()) if count_up else 0)
        assert out.dtype == torch.int64 and out.tolist() == expected.tolist()
