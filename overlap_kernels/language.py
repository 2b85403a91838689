"""The device API: what a user's own ``@triton.jit`` kernel calls to take part in a fused op.

A fused op (``overlap_kernels.FusedOp``, docs/writing_fused_ops.md) launches the
user's kernel with a :class:`Context` argument, ``ctx``, which the kernel
forwards whole to the functions below; epochs, signature words and flag slots
stay inside it. The kernel walks the tiles of an [M, N] output in the order
the op's chunk schedule makes data available (gather ops: the order rows
arrive) or needs it sent (reduce ops: peers' rows first, own rows last)::

    t = next_tile(ctx)
    while t < num_tiles(ctx):
        row_start, row_stop, col_start = tile_rows(ctx, t)
        ...                                   # wait, compute, store or send the tile
        t = next_tile(ctx)
    finish(ctx)

Every wait is bounded by the op's ``timeout_s``: past it the wait records a
timeout (the host raises OverlapTimeoutError) and returns False, and every
later wait of the workspace gives up at once, so a call fails after one
deadline and never hangs. The signal contract behind these functions is
runtime/signals.py's; each function states its ordering in one line.

Where a wait may stand: once per tile, before the tile's K loop and never
inside it (Triton's pipeliner would issue later iterations' loads before the
wait). Tiles are claimed from one counter in the schedule's order, so a tile
that waits only waits for work that running programs (or peers) do: any grid
size is safe, also in Triton's interpreter, which runs programs one by one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .kernels.gemm import round_output
from .kernels.reduce_gemm import (
    REDUCE,
    TILE_COLUMNS,
    _count_then_signal,
    _load_rows,
    _store_rows,
)
from .limits import CHUNK_FLAGS_OFFSET
from .runtime.platform import INTERPRETER
from .runtime.signals import (
    call_epoch,
    count_replayed_call,
    gave_up,
    half_offset,
    launch_budget,
    wait_flag,
    word_for_slot,
)

# Values that Triton would specialise on if they came as they are (a tuple
# argument's ints are specialised on their value whatever do_not_specialize
# says: 1 becomes a constant, multiples of 16 a variant) travel as
# ``value * 16 + WIDE`` (epochs) or ``value + WIDE`` (byte offsets, multiples
# of 256): always an int64, always a multiple of 16, never 1, so every call of
# a plan, eager or replayed, runs the one compiled kernel its first call loaded.
WIDE = 1 << 40
_WIDE = tl.constexpr(WIDE)
_INTERPRETER = tl.constexpr(INTERPRETER)
_REDUCE = tl.constexpr(REDUCE)
_COLUMNS = tl.constexpr(len(TILE_COLUMNS))
_ROW_START, _ROW_STOP, _COL_START, _ROLE, _OWNER, _SEG_START, _WAIT_SLOT = (
    tl.constexpr(TILE_COLUMNS.index(name))
    for name in ("row_start", "row_stop", "col_start", "role", "owner", "seg_start", "wait_slot")
)
_CHUNK_FLAGS_OFFSET = tl.constexpr(CHUNK_FLAGS_OFFSET)


class Context(NamedTuple):
    """What a fused op passes its kernel as ``ctx`` (built by ops/custom.py; the
    kernel forwards it whole and reads none of it). Tile table columns:
    kernels/reduce_gemm.py TILE_COLUMNS."""

    tiles: Any  # int32 [num_tiles, len(TILE_COLUMNS)]: tiles in the order they are claimed
    num_tiles: int
    programs: int  # the grid size: the last program to finish resets the claim
    counters: Any  # int32, zero between launches: piece counters, then the two claim words
    claim: int  # index of the claim words in counters
    flags: Any  # int32: this rank's chunk flags
    peers: Any  # int64 [world]: every rank's symmetric base address
    rank: int
    world: int
    slots: int  # reduce ops, wide: byte offset of the partials [world, slot_rows, n] at every rank
    slot_rows: int
    n: int  # output columns (a slot row's stride)
    half_bytes: int  # the slots move by this much for odd epochs (a replayed call of one launch)
    wait_stride: int  # reduce ops: peer src's flag for a tile is wait_slot + src * wait_stride
    first_row: int  # reduce ops: the first product row this rank owns
    epoch: int  # wide: the call's epoch, or limits.DEVICE_EPOCH / NEXT_DEVICE_EPOCH (replays)
    err: int  # the error record's address
    budget: int  # wait budget, ns
    word: int  # the call's signature word
    FAST: Any  # tl.constexpr: the compiled signals (runtime/platform.FAST_SIGNALS)


# ---- the tile walk -----------------------------------------------------------


@triton.jit
def next_tile(ctx):
    """Claim the next tile (an index; >= num_tiles(ctx) once none is left), in
    the schedule's order. Relaxed: a claim orders no memory."""
    return tl.atomic_add(ctx.counters + ctx.claim, 1, sem="relaxed", scope="gpu")


@triton.jit
def num_tiles(ctx):
    """Tiles of the call's output (this rank's share of the schedule's work)."""
    return ctx.num_tiles


@triton.jit
def tile_rows(ctx, t):
    """(row_start, row_stop, col_start) of tile ``t``: rows [row_start, row_stop)
    of the [M, N] output (a block of at most block_m rows, never across two
    chunks) and its first column. Gather ops: rows of the gathered x too; reduce
    ops: rows of the product (``first_own_row`` maps own rows to the output)."""
    entry = ctx.tiles + t * _COLUMNS
    return tl.load(entry + _ROW_START), tl.load(entry + _ROW_STOP), tl.load(entry + _COL_START)


@triton.jit
def finish(ctx):
    """Every program calls it once, last. The last program to finish resets the
    claim for the next launch (stream-ordered after this one) and counts a call
    replayed in a CUDA graph. Acquire-release on the finish count: every
    program's claims are done before the reset."""
    claim = ctx.counters + ctx.claim
    if tl.atomic_add(claim + 1, 1, sem="acq_rel", scope="gpu") == ctx.programs - 1:
        tl.atomic_xchg(claim, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(claim + 1, 0, sem="relaxed", scope="gpu")
        epoch_arg, epoch = _epochs(ctx)
        count_replayed_call(epoch_arg, epoch, ctx.flags)


# ---- gather ops: rows that arrive ----------------------------------------------


@triton.jit
def wait_rows(ctx, t):
    """Wait until the chunk that brings tile ``t``'s rows has arrived (at once
    for this rank's own rows); True, or False after the deadline. Acquire at
    system scope: loads of those rows issued after it see the chunk's bytes."""
    entry = ctx.tiles + t * _COLUMNS
    slot = tl.load(entry + _WAIT_SLOT)
    arrived = slot < 0
    if slot >= 0:
        _, epoch = _epochs(ctx)
        arrived = wait_flag(
            ctx.flags + slot, epoch, ctx.err, launch_budget(ctx.budget, ctx.flags),
            tl.load(entry + _OWNER), slot, ctx.flags, word_for_slot(slot, ctx.word), ctx.FAST,
        )  # fmt: skip
        gave_up(arrived, ctx.flags)
    return arrived


# ---- reduce ops: partials that leave, sums that wait -----------------------------


@triton.jit
def is_mine(ctx, t):
    """Whether tile ``t``'s rows are this rank's own (reduce them: wait_partials,
    add_partials) or a peer's (send them: put_tile, signal_tile)."""
    return (tl.load(ctx.tiles + t * _COLUMNS + _ROLE) & _REDUCE) != 0


@triton.jit
def first_own_row(ctx):
    """The first product row this rank owns: an own tile's output row is its product row minus this."""
    return ctx.first_row


@triton.jit
def put_tile(ctx, t, value):
    """Store ``value`` [BLOCK_M, BLOCK_N] (the output dtype) as this rank's partial
    of peer-owned tile ``t`` into the owner's slot for this rank. Plain stores to
    the peer's memory: the owner sees them only after :func:`signal_tile`'s release."""
    entry = ctx.tiles + t * _COLUMNS
    row_start = tl.load(entry + _ROW_START)
    row_stop = tl.load(entry + _ROW_STOP)
    col_start = tl.load(entry + _COL_START)
    owner_slot = _slot(ctx, tl.load(entry + _OWNER), ctx.rank, value.dtype)
    mask = _mask(row_start, row_stop, col_start, ctx.n, value.shape[0], value.shape[1])
    _store_rows(owner_slot, row_start - tl.load(entry + _SEG_START), row_stop - row_start, ctx.n,
                col_start, ctx.n, value, mask, value.shape[0], value.shape[1], False)  # fmt: skip


@triton.jit
def signal_tile(ctx, t):
    """After :func:`put_tile` of tile ``t``: count it in its piece; the tile that
    completes the piece (whichever program has it) signals the owner. Release at
    system scope: every put_tile of the piece, by every program of this rank,
    happens before the owner's :func:`wait_partials` for it returns True."""
    entry = ctx.tiles + t * _COLUMNS
    _, epoch = _epochs(ctx)
    _count_then_signal(ctx.counters, entry, ctx.peers, _CHUNK_FLAGS_OFFSET, ctx.rank, ctx.world,
                       tl.load(entry + _OWNER), epoch, 1, ctx.word, ctx.FAST)  # fmt: skip


@triton.jit
def wait_partials(ctx, t):
    """Wait until every peer's partial of own tile ``t`` has arrived here; True,
    or False after the deadline (or a peer's call that was another: the host
    raises OverlapMismatchError). Acquire at system scope: get_tile and
    add_partials after it see every peer's put_tile of the tile's piece."""
    wait_slot = tl.load(ctx.tiles + t * _COLUMNS + _WAIT_SLOT)
    _, epoch = _epochs(ctx)
    budget = launch_budget(ctx.budget, ctx.flags)
    every = budget == budget
    for src in range(ctx.world):
        if src != ctx.rank:
            slot = wait_slot + src * ctx.wait_stride
            arrived = wait_flag(ctx.flags + slot, epoch, ctx.err, budget, src, slot, ctx.flags,
                                word_for_slot(slot, ctx.word), ctx.FAST)  # fmt: skip
            gave_up(arrived, ctx.flags)
            budget = tl.where(arrived, budget, 0)
            every = every & arrived
    return every


@triton.jit
def get_tile(ctx, t, src, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Peer ``src``'s partial of own tile ``t`` (what its put_tile stored here), as
    [BLOCK_M, BLOCK_N] of DTYPE, zeros outside the tile. Plain loads of this
    rank's memory: call it after :func:`wait_partials` returned True."""
    entry = ctx.tiles + t * _COLUMNS
    row_start = tl.load(entry + _ROW_START)
    col_start = tl.load(entry + _COL_START)
    mask = _mask(row_start, tl.load(entry + _ROW_STOP), col_start, ctx.n, BLOCK_M, BLOCK_N)
    return _load_rows(_slot(ctx, ctx.rank, src, DTYPE), row_start - tl.load(entry + _SEG_START),
                      ctx.n, col_start, ctx.n, mask, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def add_partials(ctx, t, acc, DTYPE: tl.constexpr):
    """``acc`` (fp32, this rank's own partial of tile ``t``) plus every peer's
    partial of it (stored as DTYPE), in rank order, in fp32. After
    :func:`wait_partials` returned True (plain loads, as get_tile)."""
    for src in range(ctx.world):
        if src != ctx.rank:
            acc += get_tile(ctx, t, src, DTYPE, acc.shape[0], acc.shape[1]).to(tl.float32)
    return acc


# ---- arithmetic that is right in Triton's interpreter too --------------------------


@triton.jit
def dot(a, b, acc):
    """``acc + a @ b`` in fp32. fp32 operands take exact fp32 products (torch's
    default, not TF32); in Triton's interpreter bf16 operands are taken as fp32
    (its bf16 dot is wrong, and bf16 x bf16 is exact in fp32). No memory ordering."""
    if _INTERPRETER and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE, to nearest even as cuBLAS does (triton 3.6's
    interpreter truncates to bf16; this rounds by bits there). No memory ordering."""
    return round_output(x, DTYPE, _INTERPRETER and DTYPE == tl.bfloat16)  # noqa: SIM300


# ---- inside the API --------------------------------------------------------------


@triton.jit
def _epochs(ctx):
    """(the epoch argument, the call's epoch: signals.call_epoch reads a replay's)."""
    epoch_arg = ((ctx.epoch - _WIDE) >> 4).to(tl.int32)
    return epoch_arg, call_epoch(epoch_arg, ctx.flags)


@triton.jit
def _slot(ctx, owner, src, DTYPE: tl.constexpr):
    """Rank ``owner``'s slot for ``src``'s partials, in the call's buffer half, as DTYPE."""
    _, epoch = _epochs(ctx)
    offset = ctx.slots - _WIDE + half_offset(epoch, ctx.half_bytes)
    base = (tl.multiple_of(tl.load(ctx.peers + owner), 16) + offset).to(tl.pointer_type(DTYPE))
    return base + (tl.zeros((), dtype=tl.int64) + src) * ctx.slot_rows * ctx.n


@triton.jit
def _mask(row_start, row_stop, col_start, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_start + tl.arange(0, BLOCK_N)
    return (rows < row_stop)[:, None] & (cols < n)[None, :]


__all__ = [
    "Context",
    "add_partials",
    "dot",
    "finish",
    "first_own_row",
    "get_tile",
    "is_mine",
    "next_tile",
    "num_tiles",
    "put_tile",
    "round_to",
    "signal_tile",
    "tile_rows",
    "wait_partials",
    "wait_rows",
]
