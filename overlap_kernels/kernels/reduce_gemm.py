"""The producer-side persistent GEMM of gemm_rs and gemm_ar: partial products
that leave the rank tile by tile, and reductions that wait for them.

Each rank computes a partial product P_rank = A @ B; the ops need sums over
ranks of P's rows. The tile table (built on the host, in the order the
schedule says) gives each output tile a *role*, a set of bits:

    PUSH      store the partial tile into the owner's slot for this rank
              (a peer's symmetric memory: remote stores over NVLink).
    STAGE     store the partial tile into this rank's own rows region; the
              owner pulls it (copy engine or SM copy) into its slot.
    PUSH_ALL  store the partial tile into every rank's slot for this rank (one-shot).
    REDUCE    wait for every peer's partial of the tile, sum all partials in
              fp32 in rank order, scale, store to ``out``.
    PUBLISH   store the reduced tile into this rank's rows region for peers to copy.

After its stores, a PUSH/STAGE/PUSH_ALL/PUBLISH tile counts itself in its
piece's counter; the tile that completes the piece resets the counter and
signals the piece's flag (to the owner, or to every peer). Signal contract
(runtime/signals.py): a CTA barrier, then an acq_rel sys-scope counter
increment, so the last tile's release of the flag orders every tile's stores
of the piece before it. A REDUCE tile waits once per peer, after its K loop
and never inside it, and before it loads the peer's partial.

Programs claim tiles in table order from a shared counter (not round-robin):
a REDUCE tile waits only for tiles that other ranks' tables put before their
own reductions of the same piece (the schedule validator proves it), and every
tile before it was claimed by a program that is running it, or that runs it
next once the work left of its current tile, which waits for nobody, is done
(a program claims its next tile early, to hide the claim's round trip, only
then). So the launch cannot deadlock however few of its programs are
resident: another stream's kernels may hold SMs, and Triton's interpreter runs
one program after another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..limits import CHUNK_FLAGS_OFFSET
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
    word_for_slot,
)
from .gemm import (
    EpilogueConfig,
    core_launch_args,
    operand_descriptors,
    round_output,
    tile_product,
)
from .relaunch import Relaunch, launch

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

# Roles (bits of the ROLE column).
PUSH = 1
STAGE = 2
PUSH_ALL = 4
REDUCE = 8
PUBLISH = 16
_PUSH = tl.constexpr(PUSH)
_STAGE = tl.constexpr(STAGE)
_PUSH_ALL = tl.constexpr(PUSH_ALL)
_REDUCE = tl.constexpr(REDUCE)
_PUBLISH = tl.constexpr(PUBLISH)

# Tile table columns (int32), one row per output tile, in the order tiles are taken.
TILE_COLUMNS = (
    "row_start",  # rows [row_start, row_stop) of the [M, N] product
    "row_stop",
    "col_start",
    "role",
    "owner",  # rank that reduces these rows
    "seg_start",  # first row of the owner's segment: slot rows count from it
    "counter",  # piece counter this tile counts in (PUSH/STAGE/PUSH_ALL/PUBLISH)
    "expected",  # tiles in that piece
    "signal_slot",  # chunk-flag slot the completing tile sets (at the owner or every peer)
    "wait_slot",  # REDUCE: wait on chunk flag wait_slot + src * wait_stride for each peer src
    "out_row0",  # REDUCE: out row = row - out_row0
)
_ROW_START = tl.constexpr(0)
_ROW_STOP = tl.constexpr(1)
_COL_START = tl.constexpr(2)
_ROLE = tl.constexpr(3)
_OWNER = tl.constexpr(4)
_SEG_START = tl.constexpr(5)
_COUNTER = tl.constexpr(6)
_EXPECTED = tl.constexpr(7)
_SIGNAL_SLOT = tl.constexpr(8)
_WAIT_SLOT = tl.constexpr(9)
_OUT_ROW0 = tl.constexpr(10)
_NUM_COLUMNS = tl.constexpr(len(TILE_COLUMNS))

# Two words of the workspace's counters (past any piece counter a plan uses):
# the next tile to claim, and the programs that found no tile left.
CLAIM_COUNTERS = 2


@triton.jit
def _region(peer_table_ptr, rank, byte_offset, like_ptr):
    """A pointer of ``like_ptr``'s element type at ``byte_offset`` in ``rank``'s buffer."""
    addr = tl.multiple_of(tl.load(peer_table_ptr + rank), 16) + byte_offset
    return addr.to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def _count_then_signal(counters_ptr, entry, peer_table_ptr, flags_offset, rank, world, owner, epoch, to_owner,
                       word, FAST: tl.constexpr):  # fmt: skip
    """Count this tile in its piece; the tile completing the piece signals it
    (to ``owner`` when ``to_owner``, else to every peer), with the call's
    signature ``word``. signals.py ordering: barrier, the count (an acq_rel sys
    atomic that orders the counted tiles' stores before it), the words, one
    fence, relaxed flags. A piece of one tile (one-shot) needs no count."""
    counter = tl.load(entry + _COUNTER)
    expected = tl.load(entry + _EXPECTED)
    slot = tl.load(entry + _SIGNAL_SLOT)
    tl.debug_barrier()  # every thread's stores of the tile are issued
    last = expected == 1
    if expected > 1:
        done = tl.atomic_add(counters_ptr + counter, 1, sem="acq_rel", scope="sys")
        last = done == expected - 1
        if last:
            # Only this launch touches the counter, and the next launch is stream-ordered after it.
            tl.atomic_xchg(counters_ptr + counter, 0, sem="relaxed", scope="gpu")
    if last:
        for peer in range(world):
            if (to_owner & (peer == owner)) | ((to_owner == 0) & (peer != rank)):
                flags = (tl.load(peer_table_ptr + peer) + flags_offset).to(
                    tl.pointer_type(tl.int32)
                )
                post_word(flags, rank, epoch, word)
        tl.debug_barrier()  # (signals.py: barrier, then the fence)
        release_fence(slot, FAST)
        for peer in range(world):
            if (to_owner & (peer == owner)) | ((to_owner == 0) & (peer != rank)):
                flag = (tl.load(peer_table_ptr + peer) + flags_offset).to(
                    tl.pointer_type(tl.int32)
                ) + slot
                signal_one(flag, epoch, FAST)  # an atomic max: never backwards


@triton.jit
def _store_rows(base, first_row, num_rows, stride, col_start, N, value, mask,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Store ``value`` as rows [first_row, first_row + num_rows) of the row-major
    [*, stride] array at ``base``, from column ``col_start``. TMA: through a
    descriptor bounded to those rows, so nothing past them is written and no
    [BLOCK_M, BLOCK_N] pointer tensor takes registers (experimental: config
    ``epilogue="tma"``)."""
    if TMA:
        rows_base = base + first_row.to(tl.int64) * stride
        desc = tl.make_tensor_descriptor(rows_base, [num_rows, N], [stride, 1], [BLOCK_M, BLOCK_N])
        desc.store([0, col_start], value)
    else:
        offs = (first_row + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * stride
        tl.store(base + offs + (col_start + tl.arange(0, BLOCK_N))[None, :], value, mask=mask)


@triton.jit
def _load_rows(
    base, first_row, stride, col_start, N, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The tile :func:`_store_rows` stores by pointers, loaded (zeros outside ``mask``)."""
    offs = (first_row + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * stride
    return tl.load(base + offs + (col_start + tl.arange(0, BLOCK_N))[None, :], mask=mask, other=0.0)


@triton.jit
def _stores_visible(anchor, TMA: tl.constexpr, FAST: tl.constexpr):
    """Before a signal: TMA stores are asynchronous (async proxy). Wait until
    this thread's bulk stores are complete, then order them before the generic
    proxy's release that follows. (The interpreter's stores are synchronous.)"""
    if TMA:  # noqa: SIM102 - constexpr branches, each folded by Triton (and the interpreter) on its own
        if FAST:
            tl.inline_asm_elementwise(
                "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, $1;",
                "=r,r", [anchor], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip


# Per-call values are not specialised on (see kernels/gemm.py).
# The grid size is an argument, not a constexpr: the warm-up launch (one
# program, no tiles) must compile the very kernel the call runs (run.py).
@triton.jit(
    do_not_specialize=[
        "num_tiles", "num_programs", "half_bytes", "epoch", "err_addr", "wait_budget", "word",
    ]
)  # fmt: skip
def reduce_gemm_kernel(
    # operands: A [M, K] row-major, B [K, N] (stored [N, K] when B_NK), out [*, N]
    a_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_out,
    out_rows,  # rows of out
    scale,  # REDUCE multiplies the sum by it (1.0, or 1/world for "avg")
    # tiles in the order they are taken
    tiles_ptr,  # int32 [num_tiles, len(TILE_COLUMNS)]
    num_tiles,
    num_programs,  # the grid size
    # the symmetric workspace (byte offsets from every rank's base address)
    peer_table_ptr,
    rank,
    world,
    slots_offset,  # [world, slot_rows, N] partials, slot s written by rank s
    slot_rows,
    rows_offset,  # [M, N] this rank's staged partials or published sums
    half_bytes,  # both offsets move by this much for odd epochs (signals.half_offset)
    flags_offset,  # the chunk flags
    local_flags_ptr,
    wait_stride,
    counters_ptr,  # int32, local, zero between launches: piece counters, then CLAIM_COUNTERS
    num_counters,
    epoch,
    err_addr,
    wait_budget,
    word,  # the call's signature word: its signals carry it, its waits check it (signals.py)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    B_NK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FAST_SIGNALS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,
    TMA_EPILOGUE: tl.constexpr,  # partials and sums stored (and read back) through TMA descriptors
    POINTER_LOADS: tl.constexpr,  # operands read by masked loads, not TMA (config ``loads``)
):
    a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_NK,
                                         POINTER_LOADS)  # fmt: skip
    k_tiles = tl.cdiv(K, BLOCK_K)
    # int64 whether or not Triton passed slot_rows as a constant (it does for 1).
    slot_elems = (tl.zeros((), dtype=tl.int64) + slot_rows) * N
    budget = launch_budget(wait_budget, local_flags_ptr)
    epoch_arg = epoch
    epoch = call_epoch(epoch, local_flags_ptr)  # (a call replayed in a CUDA graph reads its own)
    half = half_offset(epoch, half_bytes)
    slots_offset += half
    rows_offset += half
    my_slots = _region(peer_table_ptr, rank, slots_offset, out_ptr)
    my_rows = _region(peer_table_ptr, rank, rows_offset, out_ptr)
    claim_ptr = counters_ptr + num_counters
    # Descriptors made once, for out and for this rank's slots (read only): one
    # made per tile costs a tensormap proxy fence per tile. Stores to slots and
    # to the rows region, and a partial block of out short of its end, still
    # make their own, bounded to the tile's rows.
    out_desc = out_ptr
    slots_desc = my_slots
    if TMA_EPILOGUE:
        out_desc = tl.make_tensor_descriptor(
            out_ptr, [out_rows, N], [stride_out, 1], [BLOCK_M, BLOCK_N]
        )
        slots_desc = tl.make_tensor_descriptor(
            my_slots, [world * slot_rows, N], [N, 1], [BLOCK_M, BLOCK_N]
        )
    tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
    while tile < num_tiles:
        entry = tiles_ptr + tile * _NUM_COLUMNS
        row_start = tl.load(entry + _ROW_START)
        row_stop = tl.load(entry + _ROW_STOP)
        col_start = tl.load(entry + _COL_START)
        role = tl.load(entry + _ROLE)
        owner = tl.load(entry + _OWNER)
        seg_start = tl.load(entry + _SEG_START)
        # The next tile is claimed while this one still has work that waits for
        # nobody, so the claim's round trip hides behind it: here for a tile that
        # never waits, after the waits for a reducing one. A claimed tile then
        # always runs, as the module docstring's no-deadlock argument needs.
        next_tile = tile
        if (role & _REDUCE) == 0:
            next_tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
        acc = tile_product(
            a_desc, b_desc, row_start, col_start, 0, k_tiles, M, N, K,
            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, B_NK, INPUT_PRECISION, INTERPRETED_BF16, POINTER_LOADS,
        )  # fmt: skip
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        num_rows = row_stop - row_start
        slot_row = row_start - seg_start  # the tile's first row in a slot
        # (Offsets are built inside _store_rows / _load_rows: a [BLOCK_M, BLOCK_N]
        # int64 tensor costs as many registers as the accumulator.)

        # 1. The partial leaves first: peers' reductions may be waiting for it.
        if role & (_PUSH | _STAGE | _PUSH_ALL):
            partial = round_output(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16)
            if role & _PUSH:
                owner_slot = (
                    _region(peer_table_ptr, owner, slots_offset, out_ptr) + rank * slot_elems
                )
                _store_rows(
                    owner_slot,
                    slot_row,
                    num_rows,
                    N,
                    col_start,
                    N,
                    partial,
                    mask,
                    BLOCK_M,
                    BLOCK_N,
                    TMA_EPILOGUE,
                )
            if role & _STAGE:
                _store_rows(
                    my_rows,
                    row_start,
                    num_rows,
                    N,
                    col_start,
                    N,
                    partial,
                    mask,
                    BLOCK_M,
                    BLOCK_N,
                    TMA_EPILOGUE,
                )
            if role & _PUSH_ALL:  # every rank's slot for us, our own included (see 2.)
                for peer in range(world):
                    peer_slot = (
                        _region(peer_table_ptr, peer, slots_offset, out_ptr) + rank * slot_elems
                    )
                    _store_rows(
                        peer_slot,
                        slot_row,
                        num_rows,
                        N,
                        col_start,
                        N,
                        partial,
                        mask,
                        BLOCK_M,
                        BLOCK_N,
                        TMA_EPILOGUE,
                    )
            _stores_visible(role, TMA_EPILOGUE, FAST_SIGNALS)
            to_owner = ((role & _PUSH_ALL) == 0).to(tl.int32)
            _count_then_signal(
                counters_ptr,
                entry,
                peer_table_ptr,
                flags_offset,
                rank,
                world,
                owner,
                epoch,
                to_owner,
                word,
                FAST_SIGNALS,
            )

        # 2. Reduce: wait for every peer's partial (all waits before any load of them).
        if role & _REDUCE:
            wait_slot = tl.load(entry + _WAIT_SLOT)
            for src in range(world):
                if src != rank:
                    slot = wait_slot + src * wait_stride
                    arrived = wait_flag(
                        local_flags_ptr + slot, epoch, err_addr, budget, src, slot, local_flags_ptr,
                        word_for_slot(slot, word), FAST_SIGNALS,
                    )  # fmt: skip
                    gave_up(arrived, local_flags_ptr)
                    budget = tl.where(arrived, budget, 0)
            next_tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
            # Sum in rank order. An owner starts from its own partial unrounded
            # (only it sums these rows). One-shot ranks all sum the same rounded
            # partials, their own read back from its slot (the barrier in
            # _count_then_signal ordered its stores), in the same order, so that
            # every rank computes the same bits.
            one_shot = (role & _PUSH_ALL) != 0
            if one_shot:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world):
                if (src != rank) | one_shot:
                    if TMA_EPILOGUE:  # (rows past the tile's are read too, and never stored)
                        peer_part = slots_desc.load([src * slot_rows + slot_row, col_start])
                    else:
                        peer_part = _load_rows(my_slots + src * slot_elems, slot_row, N, col_start, N, mask,
                                               BLOCK_M, BLOCK_N)  # fmt: skip
                    acc += peer_part.to(tl.float32)
            total = round_output(acc * scale, out_ptr.dtype.element_ty, INTERPRETED_BF16)
            out_row = row_start - tl.load(entry + _OUT_ROW0)
            # A box that would reach into another tile's rows stays bounded to its own.
            if TMA_EPILOGUE and ((num_rows == BLOCK_M) | (out_row + num_rows == out_rows)):
                out_desc.store([out_row, col_start], total)
            else:
                _store_rows(out_ptr, out_row, num_rows, stride_out, col_start, N, total, mask,
                            BLOCK_M, BLOCK_N, TMA_EPILOGUE)  # fmt: skip
            # 3. Publish the sum for peers that gather it.
            if role & _PUBLISH:
                _store_rows(
                    my_rows,
                    row_start,
                    num_rows,
                    N,
                    col_start,
                    N,
                    total,
                    mask,
                    BLOCK_M,
                    BLOCK_N,
                    TMA_EPILOGUE,
                )
                _stores_visible(role, TMA_EPILOGUE, FAST_SIGNALS)
                _count_then_signal(
                    counters_ptr,
                    entry,
                    peer_table_ptr,
                    flags_offset,
                    rank,
                    world,
                    owner,
                    epoch,
                    0,
                    word,
                    FAST_SIGNALS,
                )
        tile = next_tile
    # The last program out resets both claim words for the next launch (stream-ordered
    # after this one), and counts a replayed call.
    if tl.atomic_add(claim_ptr + 1, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(claim_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(claim_ptr + 1, 0, sem="relaxed", scope="gpu")
        count_replayed_call(epoch_arg, epoch, local_flags_ptr)


def launch_reduce_gemm(
    a: torch.Tensor,  # [M, K] row-major
    b: torch.Tensor,  # [K, N]: row-major, or the transpose of a row-major [N, K]
    out: torch.Tensor,  # rows REDUCE tiles store, row-major
    tiles: torch.Tensor,  # int32 [num_tiles, len(TILE_COLUMNS)]
    num_tiles: int,
    config: EpilogueConfig,
    num_programs: int,
    *,
    ws: Workspace,  # the group's Workspace
    slots_offset: int,
    slot_rows: int,
    rows_offset: int,
    wait_stride: int,
    epoch: int,
    wait_budget: int,
    scale: float = 1.0,
    fast_signals: bool = False,
    word: int = 0,
    half_bytes: int = 0,
) -> Relaunch | None:
    """Launch :func:`reduce_gemm_kernel` over the first ``num_tiles`` tiles of
    ``tiles``; the :class:`Relaunch` of it, where there is one, takes a later
    call with the same plan (only ``a_ptr``, ``b_ptr``, ``out_ptr``, ``scale``,
    ``epoch`` and the signature ``word`` may differ). ``half_bytes``: where the
    kernel picks its buffer half by the epoch's parity (a replayed call of one
    launch), the bytes between the halves; 0 where the offsets name the half."""
    b_base, core = core_launch_args(a, b, config, fast_signals)
    M, K = a.shape
    N = b.shape[1]
    programs = max(1, min(num_programs, num_tiles))
    args = (
        a, b_base, out, M, N, K, out.stride(0), out.shape[0], scale,
        tiles, num_tiles, programs,
        ws.peer_table, ws.rank, ws.world, slots_offset, slot_rows, rows_offset, half_bytes,
        CHUNK_FLAGS_OFFSET, ws.chunk_flags, wait_stride, ws.counters, ws.counters.numel() - CLAIM_COUNTERS,
        epoch, ws.error_address, wait_budget, word,
    )  # fmt: skip
    return launch(
        reduce_gemm_kernel,
        (programs,),
        args,
        dict(TMA_EPILOGUE=config.epilogue == "tma", **core),
        a.device,
    )
