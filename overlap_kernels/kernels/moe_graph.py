"""The MoE graph mode's kernels (ops/moe_graph.py): dispatch and combine, one launch each.

Nothing is sized on the host: every buffer has a fixed capacity, and the counts
that place the rows travel with them. From byte ``region`` of the call's buffer
half (signals.half_offset), every rank's symmetric buffer holds one *block* per
source rank s, ``block_bytes`` apart:

  dispatch  counts   int32 [counts_len + 1] at 0: s's counts row (kernels/routing.py:
                     HEADER, token rows to each rank, pairs to each global expert),
                     then s's capacity (the rows of its recv_x)
            tokens   [max_tokens, H] at ``tokens_at``, rows ``row_stride`` bytes apart
                     (H's, rounded up to 16): the token rows s sends here,
                     row i the i-th of s's tokens with a pair here (routing's dest_tokens)
            records  int32 [max_tokens * max_topk, 4] at ``records_at``: s's pairs of
                     this rank's experts, in (g, t, j) order (routing's records: the
                     token's row i here, t, the weight's bits, j)
  combine   partials [max_tokens, N] at 0, rows ``row_stride`` apart: owner s's weighted
                     sum of each token of this rank it received, at the token's row
                     there (routing's row_in_block)

Dispatch, one launch of P programs (all resident at once on CUDA; one program in
the interpreter, which runs a grid's programs one after another):
  1. Each program clears its share of the owner table and copies its share of
     this rank's counts row, token rows and records into the destinations' blocks
     for this rank; the last program to count its share counts a replayed call and
     signals every rank (flag W(rank), with the call's signature word).
  2. Every program waits for every source's flag.
  3. From the count matrix (every source's counts row, read here by each program
     alike): the checks below, this rank's experts' row counts and ends (clamped to
     the capacity); then each output row, in (local expert, source, token, slot)
     order: its run (expert e, source s), its record in s's block, its token row
     copied into recv_x; its source, token and weight; its owner-table entry
     (received token row (s, i), slot j -> the output row).
Combine, one launch: each program sums, for its share of the received token rows,
the weighted rows of their pairs (owner-table columns in slot order, in fp32),
rounds once and stores the sum into the token's home, in its block for this rank;
the last program signals every rank; after every owner's flag, each program sums
its share of this rank's tokens' partials (owners in rank order, fp32) and rounds
once. These are moe_combine's sums in moe_combine's order (kernels/gather_sum.py),
so a combine gives moe_combine's bits.

Checks: program 0 fills the record (int32 [RECORD_LEN] in host memory, where
empty; its code last) with the first of: a rank passing more than max_tokens
tokens (CODE_TOKENS), a top-k above max_topk (CODE_TOPK), expert ids outside
[-1, E) (CODE_IDS), a rank that would receive more rows than its capacity
(CODE_ROWS); the rank, its value and the limit (for CODE_IDS: E). Every rank
reads every counts row, so every rank records the same failure. Nothing is read past a block or
written past a buffer whatever the counts say: a push stops at its block's end,
a row past the capacity is dropped, and indices read from peers are clamped
(after a timeout they are stale).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..runtime.signals import (
    call_epoch,
    count_replayed_call,
    gave_up,
    half_offset,
    launch_budget,
    post_word,
    release_fence,
    signal_one,
    wait_flag,
)
from .gemm import round_output
from .routing import HEADER, RECORD_COLUMNS
from .transfer import CHUNK_FLAGS_WORD, words_at

# The record: code (0: nothing), epoch, the rank at fault, its value, the limit.
RECORD_LEN = 5
CODE_TOKENS, CODE_TOPK, CODE_IDS, CODE_ROWS = 1, 2, 3, 4
_CODE_TOKENS, _CODE_TOPK, _CODE_IDS, _CODE_ROWS = (
    tl.constexpr(c) for c in (CODE_TOKENS, CODE_TOPK, CODE_IDS, CODE_ROWS)
)
_HEADER_LEN = tl.constexpr(len(HEADER))
_INVALID, _TOKENS, _TOPK = (tl.constexpr(HEADER.index(n)) for n in ("invalid", "tokens", "topk"))
_RECORD = tl.constexpr(RECORD_COLUMNS)


@triton.jit
def _rows_at(address, rows, row_bytes, elem: tl.constexpr):
    """Pointers to rows ``rows`` of an array at byte ``address``, ``row_bytes`` apart:
    the blocks' rows, whose base and stride are multiples of 16 bytes (said, so that
    rows move in 16-byte vectors)."""
    ITEMSIZE: tl.constexpr = elem.primitive_bitwidth // 8
    base = tl.multiple_of(address.to(tl.pointer_type(elem)), 16)
    return base + rows.to(tl.int64) * tl.multiple_of(row_bytes // ITEMSIZE, 16 // ITEMSIZE)


@triton.jit
def _count_and_signal(done_ptr, num_programs, peer_table_ptr, rank, world, flag0, flag_stride,
                      local_flags_ptr, epoch_arg, epoch, word, FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """After a program's pushes: count them; the last program to count (every
    program has read the epoch) resets the count, counts a replayed call and
    signals every rank, with the call's ``word`` (signals.py: barrier, one fence,
    relaxed flags), as kernels/gemm.py's pushed rows do."""
    tl.debug_barrier()  # every thread's stores are issued before the count
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == num_programs - 1:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")  # for the next launch
        count_replayed_call(epoch_arg, epoch, local_flags_ptr)
        for dst in range(world):
            post_word(words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD, rank, epoch, word)
        tl.debug_barrier()
        release_fence(rank, FAST_SIGNALS)
        for dst in range(world):
            flags = words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD
            signal_one(flags + flag0 + rank * flag_stride, epoch, FAST_SIGNALS)


@triton.jit
def _wait_all(local_flags_ptr, flag0, flag_stride, world, epoch, err_addr, budget, word,
              FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """Wait for every source's flag; the budget left (0: a wait failed, or an
    earlier launch's did: signals.launch_budget)."""
    budget = launch_budget(budget, local_flags_ptr)
    for src in range(world):
        slot = flag0 + src * flag_stride
        arrived = wait_flag(local_flags_ptr + slot, epoch, err_addr, budget, src, slot,
                            local_flags_ptr, word, FAST_SIGNALS)  # fmt: skip
        gave_up(arrived, local_flags_ptr)
        budget = tl.where(arrived, budget, 0)
    return budget


@triton.jit
def _first(bad, s_idx, BLOCK_W: tl.constexpr):
    """The lowest rank where ``bad`` holds, BLOCK_W where none does."""
    return tl.min(tl.where(bad, s_idx, BLOCK_W))


@triton.jit
def _check(record_addr, epoch, s_idx, tokens, topk, invalid, rows, cap, max_tokens, max_topk,
           num_experts, BLOCK_W: tl.constexpr):  # fmt: skip
    """Fill the record with the first failure of the count matrix (module docstring),
    where the record is empty (an unread failure stays: it came first)."""
    w_tokens = _first(tokens > max_tokens, s_idx, BLOCK_W)
    w_topk = _first(topk > max_topk, s_idx, BLOCK_W)
    w_ids = _first(invalid > 0, s_idx, BLOCK_W)
    w_rows = _first(rows > cap, s_idx, BLOCK_W)
    code = tl.where(w_tokens < BLOCK_W, _CODE_TOKENS, tl.where(w_topk < BLOCK_W, _CODE_TOPK,
                    tl.where(w_ids < BLOCK_W, _CODE_IDS, tl.where(w_rows < BLOCK_W, _CODE_ROWS, 0))))  # fmt: skip
    who = tl.where(code == _CODE_TOKENS, w_tokens, tl.where(code == _CODE_TOPK, w_topk,
                   tl.where(code == _CODE_IDS, w_ids, w_rows)))  # fmt: skip
    values = tl.where(code == _CODE_TOKENS, tokens, tl.where(code == _CODE_TOPK, topk,
                      tl.where(code == _CODE_IDS, invalid, rows)))  # fmt: skip
    at = s_idx == who
    limit = tl.where(code == _CODE_TOKENS, max_tokens, tl.where(code == _CODE_TOPK, max_topk,
                     tl.where(code == _CODE_IDS, num_experts, tl.sum(tl.where(at, cap, 0)))))  # fmt: skip
    record = record_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    if code != 0:  # noqa: SIM102 (a scalar branch the interpreter takes as written)
        if tl.load(record, volatile=True) == 0:
            tl.store(record + 1, epoch)
            tl.store(record + 2, who)
            tl.store(record + 3, tl.sum(tl.where(at, values, 0)))
            tl.store(record + 4, limit)
            tl.debug_barrier()
            tl.store(record, code)


# Values that change from call to call (sizes, addresses, the epoch) are not
# specialised on: a variant compiled and loaded in the middle of a call would
# wait for the running kernels, which may wait for this rank. (Row widths and
# strides are: a plan's, fixed, and the masks and rows of 16-byte vectors need them.)
@triton.jit(
    do_not_specialize=["num_tokens", "counts_len", "capacity", "record_addr",
                       "num_programs", "rank", "world", "region", "half_bytes", "block_bytes",
                       "tokens_at", "records_at", "row_stride", "epoch", "err_addr", "budget", "word",
                       "max_tokens", "max_topk", "num_experts", "e_local"]
)  # fmt: skip
def dispatch_kernel(
    x_ptr, stride_x, num_tokens, hidden,  # this rank's x [T, H]
    # this rank's routing (kernels/routing.py): counts row, records [T * k, 4], dest_tokens [world, T]
    counts_ptr, counts_len, records_ptr, dest_tokens_ptr,
    capacity,  # rows of this rank's recv_x
    # outputs: recv_x [capacity, H]; int32 [capacity] each; the owner table int32
    # [world * max_tokens, max_topk]; int32 [e_local] twice; int32 [world]
    recv_x_ptr, src_rank_ptr, src_token_ptr, weight_bits_ptr, owner_ptr,
    expert_counts_ptr, expert_ends_ptr, recv_tokens_ptr,
    record_addr, num_programs,
    # the symmetric workspace: byte offsets from every rank's base address
    peer_table_ptr, rank, world, region, half_bytes, block_bytes, tokens_at, records_at, row_stride,
    local_flags_ptr, flag0, flag_stride, done_ptr, epoch, err_addr, budget, word,
    max_tokens, max_topk, num_experts, e_local,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_C: tl.constexpr, FAST_SIGNALS: tl.constexpr,
):  # fmt: skip
    epoch_arg = epoch
    epoch = call_epoch(epoch, local_flags_ptr)
    region += half_offset(epoch, half_bytes)
    pid = tl.program_id(0)
    elem = x_ptr.dtype.element_ty
    step = num_programs * BLOCK_C
    # 1. Push. This program's share of the owner table first (every program waits
    # below for the last program's signal, which follows every share).
    owner_len = world * max_tokens * max_topk
    for i0 in range(pid * BLOCK_C, owner_len, step):
        offs = i0 + tl.arange(0, BLOCK_C)
        tl.store(owner_ptr + offs, tl.full([BLOCK_C], -1, tl.int32), mask=offs < owner_len)
    c = tl.arange(0, BLOCK_C)
    row = tl.load(counts_ptr + c, mask=c < counts_len, other=0)
    row = tl.where(c == counts_len, capacity, row)
    for dst in range(pid, world, num_programs):
        head = tl.load(peer_table_ptr + dst) + region + rank * block_bytes
        tl.store(head.to(tl.pointer_type(tl.int32)) + c, row, mask=c <= counts_len)
    g = tl.arange(0, BLOCK_E)
    my_pairs = tl.load(counts_ptr + _HEADER_LEN + world + g, mask=g < num_experts, other=0)
    for d in range(world):
        block = tl.load(peer_table_ptr + d) + region + rank * block_bytes
        sent = tl.minimum(tl.load(counts_ptr + _HEADER_LEN + d), max_tokens)
        for r0 in range(pid * BLOCK_ROWS, sent, num_programs * BLOCK_ROWS):
            rows = r0 + tl.arange(0, BLOCK_ROWS)
            ok = rows < sent
            token = tl.load(dest_tokens_ptr + d * num_tokens + rows, mask=ok, other=0)
            # (pointers before the column offsets, 16-byte aligned: moves in vectors)
            dst_rows = _rows_at(block + tokens_at, rows, row_stride, elem)
            for c0 in range(0, hidden, BLOCK_H):
                cols = c0 + tl.arange(0, BLOCK_H)
                mask = ok[:, None] & (cols < hidden)[None, :]
                values = tl.load(x_ptr + token[:, None] * stride_x + cols[None, :], mask=mask)
                tl.store(dst_rows[:, None] + cols[None, :], values, mask=mask)
        # d's pairs: experts [d * e_local, (d + 1) * e_local), a range of the (g, t, j) order
        ours = (g >= d * e_local) & (g < (d + 1) * e_local)
        first = tl.sum(tl.where(g < d * e_local, my_pairs, 0))
        words = tl.minimum(tl.sum(tl.where(ours, my_pairs, 0)), max_tokens * max_topk) * _RECORD
        dst_words = (block + records_at).to(tl.pointer_type(tl.int32))
        for w0 in range(pid * BLOCK_C, words, step):
            offs = w0 + tl.arange(0, BLOCK_C)
            values = tl.load(records_ptr + first * _RECORD + offs, mask=offs < words)
            tl.store(dst_words + offs, values, mask=offs < words)
    _count_and_signal(done_ptr, num_programs, peer_table_ptr, rank, world, flag0, flag_stride,
                      local_flags_ptr, epoch_arg, epoch, word, FAST_SIGNALS)  # fmt: skip
    # 2. Wait for every source's blocks.
    budget = _wait_all(local_flags_ptr, flag0, flag_stride, world, epoch, err_addr, budget, word,
                       FAST_SIGNALS)  # fmt: skip
    # 3. The count matrix, the checks, the expert counts.
    mine = tl.load(peer_table_ptr + rank) + region
    s_idx = tl.arange(0, BLOCK_W)
    s_ok = s_idx < world
    heads = (mine + s_idx.to(tl.int64) * block_bytes).to(tl.pointer_type(tl.int32))
    tokens = tl.load(heads + _TOKENS, mask=s_ok, other=0)
    topk = tl.load(heads + _TOPK, mask=s_ok, other=0)
    invalid = tl.load(heads + _INVALID, mask=s_ok, other=0)
    cap = tl.load(heads + counts_len, mask=s_ok, other=0)
    received = tl.load(heads + _HEADER_LEN + rank, mask=s_ok, other=0)
    pairs = tl.load(heads[:, None] + _HEADER_LEN + world + g[None, :],
                    mask=s_ok[:, None] & (g < num_experts)[None, :], other=0)  # fmt: skip
    per_expert = tl.sum(pairs, axis=0)  # [BLOCK_E]
    rows_of_rank = tl.sum(tl.where((g // e_local)[None, :] == s_idx[:, None], per_expert[None, :], 0), axis=1)  # fmt: skip
    if (pid == 0) & (budget > 0):
        _check(record_addr, epoch, s_idx, tokens, topk, invalid, rows_of_rank, cap, max_tokens,
               max_topk, num_experts, BLOCK_W)  # fmt: skip
    e_idx = tl.arange(0, BLOCK_EL)
    e_ok = e_idx < e_local
    # [BLOCK_EL, BLOCK_W]: pairs for this rank's expert e from source s (clamped: a
    # stale count after a timeout must not run the loops below for long)
    cnt = tl.load(heads[None, :] + _HEADER_LEN + world + rank * e_local + e_idx[:, None],
                  mask=e_ok[:, None] & s_ok[None, :], other=0)  # fmt: skip
    cnt = tl.minimum(tl.maximum(cnt, 0), max_tokens * max_topk)
    per_e = tl.sum(cnt, axis=1)
    ends = tl.cumsum(per_e, 0)
    clamped = tl.minimum(ends, capacity)
    total = tl.where(budget > 0, tl.max(clamped), 0)
    if pid == 0:
        tl.store(expert_ends_ptr + e_idx, clamped, mask=e_ok)
        tl.store(expert_counts_ptr + e_idx, clamped - tl.minimum(ends - per_e, capacity), mask=e_ok)
        tl.store(
            recv_tokens_ptr + s_idx, tl.minimum(tl.maximum(received, 0), max_tokens), mask=s_ok
        )
    # 4. Output rows: runs (e, s) in e-major order, q = e * BLOCK_W + s.
    lens = tl.reshape(cnt, [BLOCK_EL * BLOCK_W])
    starts = tl.cumsum(lens, 0) - lens
    first_record = tl.reshape(tl.cumsum(cnt, 0) - cnt, [BLOCK_EL * BLOCK_W])  # within s's records
    q = tl.arange(0, BLOCK_EL * BLOCK_W)
    last_record = max_tokens * max_topk - 1
    for r0 in range(pid * BLOCK_ROWS, total, num_programs * BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        ok = rows < total
        run = tl.sum((starts[None, :] <= rows[:, None]).to(tl.int32), axis=1) - 1
        hit = q[None, :] == run[:, None]
        start = tl.sum(tl.where(hit, starts[None, :], 0), axis=1)
        index = tl.sum(tl.where(hit, first_record[None, :], 0), axis=1) + rows - start
        s = run % BLOCK_W
        block = mine + s.to(tl.int64) * block_bytes
        record = (block + records_at).to(tl.pointer_type(tl.int32)) + tl.minimum(tl.maximum(index, 0), last_record) * _RECORD  # fmt: skip
        i = tl.load(record, mask=ok, other=0)
        i = tl.minimum(tl.maximum(i, 0), max_tokens - 1)
        token = tl.load(record + 1, mask=ok, other=0)
        bits = tl.load(record + 2, mask=ok, other=0)
        j = tl.load(record + 3, mask=ok, other=-1)
        src_rows = _rows_at(block + tokens_at, i, row_stride, elem)
        for c0 in range(0, hidden, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            mask = ok[:, None] & (cols < hidden)[None, :]
            values = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
            tl.store(
                recv_x_ptr + rows[:, None].to(tl.int64) * hidden + cols[None, :], values, mask=mask
            )
        tl.store(src_rank_ptr + rows, s, mask=ok)
        tl.store(src_token_ptr + rows, token, mask=ok)
        tl.store(weight_bits_ptr + rows, bits, mask=ok)
        j_ok = ok & (j >= 0) & (j < max_topk)
        tl.store(owner_ptr + (s * max_tokens + i) * max_topk + j, rows, mask=j_ok)


@triton.jit(
    do_not_specialize=["num_tokens", "num_programs", "rank",
                       "world", "region", "half_bytes", "block_bytes", "row_stride", "epoch", "err_addr",
                       "budget", "word", "max_tokens", "max_topk"]
)  # fmt: skip
def combine_kernel(
    y_ptr, stride_y, width,  # y [capacity, N]: the expert outputs in recv_x's rows
    # the dispatch's: fp32 [capacity]; int32 [world * max_tokens, max_topk]; int32 [world]
    weights_ptr, owner_ptr, recv_tokens_ptr,
    row_in_block_ptr, num_tokens, out_ptr, stride_out,  # home: routing's int64 [T, world]; out [T, N]
    num_programs, peer_table_ptr, rank, world, region, half_bytes, block_bytes, row_stride,
    local_flags_ptr, flag0, flag_stride, done_ptr, epoch, err_addr, budget, word,
    max_tokens, max_topk,
    BLOCK_N: tl.constexpr, INTERPRETED_BF16: tl.constexpr, FAST_SIGNALS: tl.constexpr,
):  # fmt: skip
    epoch_arg = epoch
    epoch = call_epoch(epoch, local_flags_ptr)
    region += half_offset(epoch, half_bytes)
    pid = tl.program_id(0)
    src_dtype = y_ptr.dtype.element_ty
    num_cb = tl.cdiv(width, BLOCK_N)
    # 1. Owner: each received token row's weighted pairs, summed, into its home.
    for s in range(world):
        n = tl.minimum(tl.load(recv_tokens_ptr + s), max_tokens)
        home = tl.load(peer_table_ptr + s) + region + rank * block_bytes
        for item in range(pid, n * num_cb, num_programs):
            i = item // num_cb
            cols = (item % num_cb) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < width
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in range(max_topk):  # kernels/gather_sum.py's sum, column by column
                row = tl.load(owner_ptr + (s * max_tokens + i) * max_topk + j)
                if row >= 0:
                    values = tl.load(y_ptr + row.to(tl.int64) * stride_y + cols, mask=mask, other=0.0).to(tl.float32)  # fmt: skip
                    values = values * tl.load(weights_ptr + row)
                    acc += values
            dst = _rows_at(home, i, row_stride, src_dtype) + cols
            tl.store(dst, round_output(acc, src_dtype, INTERPRETED_BF16), mask=mask)
    _count_and_signal(done_ptr, num_programs, peer_table_ptr, rank, world, flag0, flag_stride,
                      local_flags_ptr, epoch_arg, epoch, word, FAST_SIGNALS)  # fmt: skip
    # 2. Home: every owner's partials of each token, in rank order.
    budget = _wait_all(local_flags_ptr, flag0, flag_stride, world, epoch, err_addr, budget, word,
                       FAST_SIGNALS)  # fmt: skip
    mine = tl.load(peer_table_ptr + rank) + region
    out_dtype = out_ptr.dtype.element_ty
    for item in range(pid, num_tokens * num_cb, num_programs):
        t = (item // num_cb).to(tl.int64)
        cols = (item % num_cb) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < width
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d in range(world):
            i = tl.load(row_in_block_ptr + t * world + d)
            if (i >= 0) & (i < max_tokens):
                src = _rows_at(mine + d * block_bytes, i, row_stride, src_dtype) + cols
                acc += tl.load(src, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, round_output(acc, out_dtype, INTERPRETED_BF16), mask=mask)  # fmt: skip


__all__ = ["CODE_IDS", "CODE_ROWS", "CODE_TOKENS", "CODE_TOPK", "RECORD_LEN", "combine_kernel",
           "dispatch_kernel"]  # fmt: skip
