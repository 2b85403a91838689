"""MoE routing on the device, without sorts: stable compactions by scan.

Every slot (t, j) of topk_ids has a key: its expert, or ``num_experts`` when
the slot is unused or invalid. Two launches order the slots by key, stably
(so in (key, t, j) order), one program per key:

    count_kernel   counts[key] = the slots with that key
    place_kernel   order[base[key] + i] = the i-th slot with that key, in slot order

and one launch finds, per destination rank, the tokens that send it a row:

    rows_kernel    row_in_block[t, d] = the token's row in d's block (-1: none),
                   tokens[d, :count[d]] = those tokens, ascending; count[d]

A program scans all slots (or tokens) in blocks and places its matches with a
cumulative sum, so the order is stable with no atomics and no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # slots (or tokens) a program scans per step


# Sizes change call to call: not specialised on (a compile mid-call holds up the peers).
@triton.jit(do_not_specialize=["num_slots"])
def count_kernel(keys_ptr, num_slots, counts_ptr, BLOCK: tl.constexpr):
    key = tl.program_id(0)
    total = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keys = tl.load(keys_ptr + offs, mask=offs < num_slots, other=-1)
        total += tl.sum((keys == key).to(tl.int32))
    tl.store(counts_ptr + key, total)


@triton.jit(do_not_specialize=["num_slots"])
def place_kernel(keys_ptr, num_slots, base_ptr, order_ptr, BLOCK: tl.constexpr):
    key = tl.program_id(0)
    placed = tl.load(base_ptr + key)
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        match = tl.load(keys_ptr + offs, mask=offs < num_slots, other=-1) == key
        rank = tl.cumsum(match.to(tl.int32), 0) - 1
        tl.store(order_ptr + placed + rank, offs.to(tl.int64), mask=match)
        placed += tl.sum(match.to(tl.int32))


@triton.jit(do_not_specialize=["num_tokens"])
def rows_kernel(
    keys_ptr, num_tokens, k, experts_per_rank,  # keys [T, k] (num_experts: no expert)
    row_in_block_ptr, tokens_ptr, counts_ptr,  # int64 [T, world], int64 [world, T], int64 [world]
    world, BLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    d = tl.program_id(0)
    lo, hi = d * experts_per_rank, (d + 1) * experts_per_rank
    placed = tl.zeros((), dtype=tl.int32)
    slots = tl.arange(0, K)
    for start in range(0, num_tokens, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        inside = tokens < num_tokens
        keys = tl.load(keys_ptr + tokens[:, None] * k + slots[None, :], mask=inside[:, None] & (slots < k)[None, :], other=-1)
        sends = tl.max(((keys >= lo) & (keys < hi)).to(tl.int32), axis=1) > 0
        row = placed + tl.cumsum(sends.to(tl.int32), 0) - 1
        tl.store(row_in_block_ptr + tokens.to(tl.int64) * world + d, tl.where(sends, row, -1).to(tl.int64), mask=inside)
        tl.store(tokens_ptr + d * num_tokens + row, tokens.to(tl.int64), mask=sends)
        placed += tl.sum(sends.to(tl.int32))
    tl.store(counts_ptr + d, placed.to(tl.int64))


def stable_order(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): ``order`` sorts ``keys`` (int64, values in [0, num_keys)) stably."""
    counts = torch.empty(num_keys, dtype=torch.int32, device=keys.device)
    order = torch.empty(keys.numel(), dtype=torch.int64, device=keys.device)
    if keys.numel() == 0:
        return order, counts.zero_()
    count_kernel[(num_keys,)](keys, keys.numel(), counts, BLOCK=_BLOCK)
    base = (counts.cumsum(0) - counts).to(torch.int64)
    place_kernel[(num_keys,)](keys, keys.numel(), base, order, BLOCK=_BLOCK)
    return order, counts


def token_rows(keys: torch.Tensor, world: int, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For keys [T, k]: (row_in_block [T, world] (-1: no row), tokens [world, T]
    (the first counts[d] of row d are the tokens sending d a row), counts [world])."""
    t, k = keys.shape
    device = keys.device
    row_in_block = torch.empty((t, world), dtype=torch.int64, device=device)
    tokens = torch.empty((world, t), dtype=torch.int64, device=device)
    counts = torch.zeros(world, dtype=torch.int64, device=device)
    if t:
        rows_kernel[(world,)](
            keys, t, k, experts_per_rank, row_in_block, tokens, counts, world,
            BLOCK=max(16, _BLOCK // triton.next_power_of_2(k)),  # from k alone: one variant per model
            K=triton.next_power_of_2(k),
        )  # fmt: skip
    return row_in_block, tokens, counts
