"""MoE routing on the device, without sorts: stable compactions by scan.

A *slot* (t, j) of topk_ids [T, k] is a *pair* when its expert id g is in
[0, E); -1 marks an unused slot, anything else is counted as invalid. Three
launches, no host sync, no torch ops between them:

    rows_kernel    (one program per destination rank d) the tokens that send d
                   a row: row_in_block[t, d] = the token's row in d's block
                   (-1: none), tokens[d, :n] = those tokens ascending, n into
                   the counts row
    count_kernel   (one program per expert g) the pairs of g into the counts
                   row; program 0 also writes the header (invalid slots, T, H,
                   itemsize, E, k)
    place_kernel   (one program per expert g) the pairs in (g, t, j) order:
                   their records and slots, from g's first position (the sum
                   of the counts of the experts before it)

A program scans all slots (or tokens) in blocks and places its matches with a
cumulative sum, so every order is stable with no atomics.

A pair *record* is four int32: (the token's row in its destination's block,
t, the routing weight's fp32 bits, j). The sender turns the first field into
the row in the receiver's buffer once the count exchange has told it where
its block lands (moe_details/steps.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # slots (or tokens) a program scans per step
# The counts row a rank exchanges: HEADER, then token rows to each rank, then pairs to each expert.
HEADER = ("invalid", "tokens", "hidden", "itemsize", "experts", "topk")
RECORD_COLUMNS = 4  # a pair record: (row, t, weight bits, j), above
_RECORD = tl.constexpr(RECORD_COLUMNS)


# Sizes change call to call: not specialised on (a compile mid-call holds up the peers).
@triton.jit(do_not_specialize=["num_tokens"])
def rows_kernel(
    ids_ptr, num_tokens, k, experts_per_rank,  # topk_ids [T, k]
    row_in_block_ptr, tokens_ptr, sends_ptr,  # int64 [T, world], int64 [world, T], int32 [world]
    world, BLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    d = tl.program_id(0)
    lo, hi = d * experts_per_rank, (d + 1) * experts_per_rank
    placed = tl.zeros((), dtype=tl.int32)
    slots = tl.arange(0, K)
    for start in range(0, num_tokens, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        inside = tokens < num_tokens
        ids = tl.load(
            ids_ptr + tokens[:, None] * k + slots[None, :],
            mask=inside[:, None] & (slots < k)[None, :],
            other=-1,
        )
        sends = tl.max(((ids >= lo) & (ids < hi)).to(tl.int32), axis=1) > 0
        row = placed + tl.cumsum(sends.to(tl.int32), 0) - 1
        tl.store(
            row_in_block_ptr + tokens.to(tl.int64) * world + d,
            tl.where(sends, row, -1).to(tl.int64),
            mask=inside,
        )
        tl.store(tokens_ptr + d * num_tokens + row, tokens.to(tl.int64), mask=sends)
        placed += tl.sum(sends.to(tl.int32))
    tl.store(sends_ptr + d, placed)


@triton.jit(do_not_specialize=["num_tokens"])
def count_kernel(
    ids_ptr, num_tokens, k, num_experts,
    header_ptr, pairs_ptr,  # int32: the counts row's header and its pairs per expert
    hidden, itemsize, BLOCK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    num_slots = num_tokens * k
    pairs = tl.zeros((), dtype=tl.int32)
    invalid = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        pairs += tl.sum((ids == g).to(tl.int32))
        invalid += tl.sum(((ids < -1) | (ids >= num_experts)).to(tl.int32))
    tl.store(pairs_ptr + g, pairs)
    if g == 0:  # in HEADER's order
        tl.store(header_ptr + 0, invalid)
        tl.store(header_ptr + 1, num_tokens)
        tl.store(header_ptr + 2, hidden)
        tl.store(header_ptr + 3, itemsize)
        tl.store(header_ptr + 4, num_experts)
        tl.store(header_ptr + 5, k)


@triton.jit(do_not_specialize=["num_tokens"])
def place_kernel(
    ids_ptr, weights_ptr, num_tokens, k, experts_per_rank,  # topk_ids, topk_weights [T, k]
    pairs_ptr, row_in_block_ptr, world,  # count_kernel's and rows_kernel's outputs
    records_ptr, pair_slots_ptr,  # int32 [T * k, RECORD_COLUMNS], int64 [T * k]: pairs in (g, t, j) order
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    placed = tl.sum(tl.load(pairs_ptr + experts, mask=experts < g, other=0))
    d = g // experts_per_rank
    num_slots = num_tokens * k
    for start in range(0, num_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        match = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1) == g
        at = (placed + tl.cumsum(match.to(tl.int32), 0) - 1).to(tl.int64)
        token = offs // k
        row = tl.load(row_in_block_ptr + token.to(tl.int64) * world + d, mask=match, other=0)
        weight = tl.load(weights_ptr + offs, mask=match, other=0.0).to(tl.float32)
        record = records_ptr + at * _RECORD
        tl.store(record + 0, row.to(tl.int32), mask=match)
        tl.store(record + 1, token, mask=match)
        tl.store(record + 2, weight.to(tl.int32, bitcast=True), mask=match)
        tl.store(record + 3, offs - token * k, mask=match)
        tl.store(pair_slots_ptr + at, offs.to(tl.int64), mask=match)
        placed += tl.sum(match.to(tl.int32))


def route_pairs(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    world: int,
    num_experts: int,
    counts_row: torch.Tensor,
    hidden: int,
    itemsize: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill ``counts_row`` (int32 [len(HEADER) + world + E]) and return
    (records [T * k, RECORD_COLUMNS], pair_slots [T * k], row_in_block [T, world],
    tokens [world, T]): the first (sum of the pair counts) records and slots are
    the pairs in (g, t, j) order, the first n_d tokens of row d those sending d
    a row. ``topk_ids`` and ``topk_weights`` are contiguous."""
    t, k = topk_ids.shape
    device = topk_ids.device
    header, sends, pairs = counts_row.split([len(HEADER), world, num_experts])
    row_in_block = torch.empty((t, world), dtype=torch.int64, device=device)
    tokens = torch.empty((world, t), dtype=torch.int64, device=device)
    records = torch.empty((t * k, RECORD_COLUMNS), dtype=torch.int32, device=device)
    pair_slots = torch.empty(t * k, dtype=torch.int64, device=device)
    e_local = num_experts // world
    if t:
        rows_kernel[(world,)](
            topk_ids, t, k, e_local, row_in_block, tokens, sends, world,
            BLOCK=max(16, _BLOCK // triton.next_power_of_2(k)),  # from k alone: one variant per model
            K=triton.next_power_of_2(k),
        )  # fmt: skip
    else:
        sends.zero_()
    count_kernel[(num_experts,)](
        topk_ids, t, k, num_experts, header, pairs, hidden, itemsize, BLOCK=_BLOCK
    )
    if t:
        place_kernel[(num_experts,)](
            topk_ids, topk_weights, t, k, e_local, pairs, row_in_block, world, records, pair_slots,
            BLOCK=_BLOCK, BLOCK_E=triton.next_power_of_2(num_experts),
        )  # fmt: skip
    return records, pair_slots, row_in_block, tokens
