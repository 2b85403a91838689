"""One-shot all-reduce over peer memory, with residual add and RMSNorm fused after it.

Each rank holds x [M, N]; every rank needs the sum over ranks (the all-reduce),
or, with ``NORM``, a decoder layer's step after its reduction:
``residual_out = residual + sum_r x_r`` and ``normed = rmsnorm(residual_out) * weight``.

The [M, N] array is cut into blocks of BLOCK_ROWS x BLOCK_COLS. One launch, two phases:

1. Push: each program copies its blocks of x into every peer's slot for this
   rank (remote stores over NVLink, no multicast) and signals each block at
   every peer (signals.py: barrier, one sys-scope fence, relaxed flags, each
   with the call's signature word).
2. Reduce: each program waits for every peer's copy of its blocks (without
   ``NORM``), or of every block of its row blocks (``NORM``: a row's statistics
   need all of it), and sums the partials in fp32 in rank order, this rank's
   own read from x itself: every rank adds the same values in the same order,
   so every rank gets the same bits. ``NORM`` then adds the residual, rounds
   that to the output dtype (``residual_out``), and scales the rounded rows by
   ``rsqrt(mean(square) + eps)`` (statistics in fp32) and the weight.

A program waits only for peers' pushes, which no peer makes wait for anything,
so the launch cannot deadlock as long as every program of every rank runs: on
CUDA a grid of at most one program per SM (all resident at once), in Triton's
interpreter (programs run one after another) one program.

Flags: source s announces block b at flag ``flag0 + s * flag_stride + b`` of
its peers, in its own range of the peers' flags (limits.writer_flags). Slots:
``world`` row-major [M, N], ``slot_bytes`` apart from ``slots_offset`` of every
rank's buffer, in the call's buffer half (``half_bytes``: signals.half_offset). A replayed call (epoch
limits.NEXT_DEVICE_EPOCH) reads its epoch on the device and its last program
counts it (signals.count_replayed_call).
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
from .transfer import CHUNK_FLAGS_WORD, words_at


@triton.jit
def _block(rb, cb, M, N, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Row and column indices of block (rb, cb), and its mask."""
    rows = rb * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = cb * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows, cols, mask


@triton.jit
def _slot(peer_table_ptr, owner, src, slots_offset, slot_bytes, like_ptr):
    """Rank ``owner``'s slot for source ``src``: a row-major [M, N] of like_ptr's type.
    Slots start ``slot_bytes`` apart, a multiple of 256 (as the offset and every
    buffer's base are): said, so that blocks move as 16-byte vectors."""
    base = tl.load(peer_table_ptr + owner) + slots_offset
    addr = tl.multiple_of(base + (tl.zeros((), dtype=tl.int64) + src) * slot_bytes, 16)
    return addr.to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def _partial_sum(x_ptr, stride_x, peer_table_ptr, rank, world, slots_offset, slot_bytes, rows, cols, mask,
                 N):  # fmt: skip
    """The fp32 sum over ranks of the block's partials, in rank order, this
    rank's read from x (its peers sum the copy it pushed: the same values)."""
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for src in range(world):
        if src == rank:
            x_offs = rows[:, None].to(tl.int64) * stride_x + cols[None, :]
            part = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        else:
            slot = _slot(peer_table_ptr, rank, src, slots_offset, slot_bytes, x_ptr)
            part = tl.load(slot + offs, mask=mask, other=0.0)
        acc += part.to(tl.float32)
    return acc


@triton.jit
def _wait_blocks(local_flags_ptr, flag0, flag_stride, first_block, num_blocks, rank, world, epoch,
                 err_addr, budget, word, FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """Wait for every peer's signal of blocks [first_block, first_block + num_blocks)."""
    for src in range(world):
        if src != rank:
            for b in range(first_block, first_block + num_blocks):
                slot = flag0 + src * flag_stride + b
                arrived = wait_flag(local_flags_ptr + slot, epoch, err_addr, budget, src, slot,
                                    local_flags_ptr, word, FAST_SIGNALS)  # fmt: skip
                gave_up(arrived, local_flags_ptr)
                budget = tl.where(arrived, budget, 0)
    return budget


# Values that change from call to call are not specialised on (kernels/gemm.py says why).
@triton.jit(
    do_not_specialize=["M", "num_programs", "half_bytes", "epoch", "err_addr", "wait_budget",
                       "word", "eps"]
)  # fmt: skip
def all_reduce_kernel(
    # this rank's x [M, N] (row stride stride_x); out [M, N]: the sum, or with NORM residual_out
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    M,
    N,
    # NORM: residual [M, N] (RESIDUAL only), normed [M, N], weight [N], eps
    residual_ptr,
    stride_residual,
    normed_ptr,
    stride_normed,
    weight_ptr,
    eps,
    num_programs,  # the grid size
    # the symmetric workspace (byte offsets from every rank's base address)
    peer_table_ptr,
    rank,
    world,
    slots_offset,  # world slots of [M, N], slot s written by rank s
    slot_bytes,  # between two slots (a multiple of 256)
    half_bytes,  # the slots move by this much for odd epochs (signals.half_offset)
    local_flags_ptr,  # this rank's chunk flags
    flag0,
    flag_stride,
    done_ptr,  # int32 [1], zero between launches: programs finished
    epoch,
    err_addr,
    wait_budget,
    word,  # the call's signature word: its signals carry it, its waits check it
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
    FAST_SIGNALS: tl.constexpr,
):
    epoch_arg = epoch
    epoch = call_epoch(epoch, local_flags_ptr)
    slots_offset += half_offset(epoch, half_bytes)
    num_cb = tl.cdiv(N, BLOCK_COLS)
    num_rb = tl.cdiv(M, BLOCK_ROWS)
    pid = tl.program_id(0)
    out_dtype = out_ptr.dtype.element_ty

    # 1. Push this rank's blocks to every peer, each signalled as soon as it is out
    # (none at one rank: the local launch of the plain path and of world 1).
    pushed = tl.where(world > 1, num_rb * num_cb, 0)
    if pid < pushed:  # the call's word, once, ahead of every signal of this program's
        for dst in range(world):
            if dst != rank:
                post_word(words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD, rank, epoch, word)
    for b in range(pid, pushed, num_programs):
        rows, cols, mask = _block(b // num_cb, b % num_cb, M, N, BLOCK_ROWS, BLOCK_COLS)
        tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        for dst in range(world):
            if dst != rank:
                tl.store(_slot(peer_table_ptr, dst, rank, slots_offset, slot_bytes, x_ptr) + offs, tile,
                         mask=mask)  # fmt: skip
        tl.debug_barrier()  # every thread's stores are issued before the fence
        release_fence(b, FAST_SIGNALS)
        for dst in range(world):
            if dst != rank:
                flags = words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD
                signal_one(flags + flag0 + rank * flag_stride + b, epoch, FAST_SIGNALS)

    # 2. Reduce what every peer pushed here.
    budget = launch_budget(wait_budget, local_flags_ptr)
    if NORM:
        for rb in range(pid, num_rb, num_programs):
            budget = _wait_blocks(local_flags_ptr, flag0, flag_stride, rb * num_cb, num_cb, rank, world,
                                  epoch, err_addr, budget, word, FAST_SIGNALS)  # fmt: skip
            squares = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
            for cb in range(num_cb):
                rows, cols, mask = _block(rb, cb, M, N, BLOCK_ROWS, BLOCK_COLS)
                acc = _partial_sum(x_ptr, stride_x, peer_table_ptr, rank, world, slots_offset,
                                   slot_bytes, rows, cols, mask, N)  # fmt: skip
                if RESIDUAL:
                    res_offs = rows[:, None].to(tl.int64) * stride_residual + cols[None, :]
                    acc += tl.load(residual_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
                summed = round_output(acc, out_dtype, INTERPRETED_BF16)
                out_offs = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
                tl.store(out_ptr + out_offs, summed, mask=mask)
                value = tl.where(mask, summed.to(tl.float32), 0.0)
                squares += tl.sum(value * value, axis=1)
            scale = 1.0 / tl.sqrt(squares / N + eps)  # (the rounded rows' statistics, in fp32)
            tl.debug_barrier()  # residual_out is read back below, maybe by other threads than stored it
            for cb in range(num_cb):
                rows, cols, mask = _block(rb, cb, M, N, BLOCK_ROWS, BLOCK_COLS)
                out_offs = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
                summed = tl.load(out_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
                weight = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                normed = summed * scale[:, None] * weight[None, :]
                normed_offs = rows[:, None].to(tl.int64) * stride_normed + cols[None, :]
                tl.store(normed_ptr + normed_offs, round_output(normed, out_dtype, INTERPRETED_BF16),
                         mask=mask)  # fmt: skip
    else:
        for b in range(pid, num_rb * num_cb, num_programs):
            budget = _wait_blocks(local_flags_ptr, flag0, flag_stride, b, 1, rank, world, epoch,
                                  err_addr, budget, word, FAST_SIGNALS)  # fmt: skip
            rows, cols, mask = _block(b // num_cb, b % num_cb, M, N, BLOCK_ROWS, BLOCK_COLS)
            acc = _partial_sum(x_ptr, stride_x, peer_table_ptr, rank, world, slots_offset,
                               slot_bytes, rows, cols, mask, N)  # fmt: skip
            out_offs = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
            tl.store(out_ptr + out_offs, round_output(acc, out_dtype, INTERPRETED_BF16), mask=mask)

    # The last program out (every program has read the epoch) resets the count for
    # the next launch, stream-ordered after this one, and counts a replayed call.
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
        count_replayed_call(epoch_arg, epoch, local_flags_ptr)


__all__ = ["all_reduce_kernel"]
