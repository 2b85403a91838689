"""The chunk-aware persistent GEMM: C = A @ B, walking M-blocks in arrival order.

The M-block table lists output row blocks in the order their rows become
available (a schedule's arrival order; plain row order for a local GEMM), each
with the chunk flag that announces its rows (-1: present before the launch).
Persistent programs take tiles round-robin in a grouped (L2-friendly) order
over that table, wait once per tile on the tile's flag (signals.py contract:
before the pipelined K loop, never inside it), then run the K loop at full
speed, reading A and B through TMA tensor descriptors or, with config
``loads = "pointer"`` (decode tiles: a weight read that way ran faster), by
masked loads.

A block never spans two chunks: each chunk's rows are cut into blocks of its
own, the last one masked, so one flag covers a block. A group of blocks may
(ag_gemm's ``group_by_chunk`` ends every group with its chunk: ``group_span``).

Epilogue (config ``epilogue``): "pointer" stores a tile from registers;
"tma" hands a whole block's tile to one asynchronous TMA store through a
descriptor of C made once per program, so the next tile's K loop starts while
the store drains. A block cut short by its chunk's end takes the pointer
store: the descriptor is bounded by C, not by the chunk, and would write the
rows of the next chunk's first block. So do a split tail's tiles, whose sum
is stored in steps of SUM_ROWS rows.

Pushed rows (ag_gemm's mechanism "push", for decode sizes): before any tile,
every program copies its share of this rank's rows into every rank's gathered
buffer; the last program to count its share signals each rank (one flag per
source, set only by that source: limits.writer_flags);
then every program waits for every source's flag and runs its tiles with no
further wait. One launch for the whole call: at decode sizes launches are its
time. The interpreter runs the programs one after another, so there the grid
is one program (a program waiting for a later one's count would wait forever).

Split tail (config ``split_tail``): when the tiles leave the last wave of
programs less than half full, each of that wave's tiles is cut along K into
as many pieces (up to MAX_TAIL_PIECES) as there are programs to take them, so
the last wave takes a fraction of a tile's time. The pieces' fp32 sums meet in
a scratch buffer; the last piece of a tile to finish adds them. (Not a stream-K
tail, with contiguous K ranges per program: its programs sit at different K
offsets and share little in L2; docs/performance.md, "Tried and withdrawn".)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver

from ..limits import DEVICE_EPOCH
from ..runtime.platform import INTERPRETER
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
from .relaunch import Relaunch, ensure_descriptor_allocator, launch
from .transfer import CHUNK_FLAGS_WORD, words_at


class TileConfig(Protocol):
    """What a launch of the GEMM core reads from an op's config (the ops' config
    classes have these fields; kernels do not import ops)."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    allow_tf32: bool


class EpilogueConfig(TileConfig, Protocol):
    """A TileConfig with how the dense GEMM kernels read their operands and store their tiles."""

    loads: str
    epilogue: str


class ChunkedGemmConfig(EpilogueConfig, Protocol):
    """An EpilogueConfig with the chunked GEMM's tile order and split of the last wave."""

    group_m: int
    split_tail: bool


# M-block table columns (int32): rows [start, stop), chunk-flag slot (-1: no wait), source rank.
# (tl.constexpr: kernels may read module globals only when they are constexpr.)
MBLOCK_START = tl.constexpr(0)
MBLOCK_STOP = tl.constexpr(1)
MBLOCK_FLAG = tl.constexpr(2)
MBLOCK_SRC = tl.constexpr(3)
MBLOCK_COLUMNS = tl.constexpr(4)


@triton.jit
def _grouped_tile(tile, num_mblocks, num_nblocks, group_span, GROUP_M: tl.constexpr):
    """(m-block, n-block) of ``tile``: GROUP_M m-blocks share each sweep over N,
    so the B columns they read stay in L2; m-blocks keep arrival order. No group
    crosses a multiple of ``group_span`` m-blocks (a chunk's, where every chunk
    has that many: a group across two would hold tiles of this chunk behind
    waits for the next; num_mblocks: groups run on across chunks)."""
    tiles_per_span = group_span * num_nblocks
    span_first = (tile // tiles_per_span) * group_span
    span_rows = tl.minimum(num_mblocks - span_first, group_span)
    in_span = tile % tiles_per_span
    tiles_per_group = GROUP_M * num_nblocks
    first_mblock = (in_span // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(span_rows - first_mblock, GROUP_M)
    in_group = in_span % tiles_per_group
    return span_first + first_mblock + in_group % group_rows, in_group // group_rows


# torch dtype -> Triton dtype, for kernels that take an element type as a constexpr.
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def round_output(acc, OUT_DTYPE: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """fp32 accumulator -> output dtype, rounding to nearest even as cuBLAS does.
    triton 3.6's interpreter truncates fp32 -> bf16, so there it rounds by bits."""
    if INTERPRETED_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(OUT_DTYPE)
    return out


@triton.jit
def operand_descriptors(a_ptr, b_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, B_NK: tl.constexpr, POINTER_LOADS: tl.constexpr):  # fmt: skip
    """What tile_product reads A [M, K] row-major and B [K, N] (stored [N, K] when B_NK)
    through: their TMA descriptors, or with POINTER_LOADS their base pointers."""
    if POINTER_LOADS:
        a_desc, b_desc = a_ptr, b_ptr
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
        if B_NK:
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.jit
def tile_product(
    a_desc, b_desc, row_start, col_start, k_first, k_stop, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    B_NK: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRETED_BF16: tl.constexpr,
    POINTER_LOADS: tl.constexpr,
):  # fmt: skip
    """The fp32 accumulator of one output tile over K steps [k_first, k_stop)
    of BLOCK_K each: the software-pipelined K loop, written once for every
    GEMM of the library. Nothing that waits on a flag may stand inside it
    (signals.py). The operands come from :func:`operand_descriptors`; with
    POINTER_LOADS they are read by masked loads (rows past M and columns past N
    read as zeros, as TMA's bounds give them)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
    for kt in tl.range(k_first, k_stop, num_stages=NUM_STAGES):
        if POINTER_LOADS:
            k = (kt * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
            a = tl.load(a_desc + rows[:, None] * K + k[None, :],
                        mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
            b_mask = (k[:, None] < K) & (cols[None, :] < N)
            if B_NK:
                b = tl.load(b_desc + cols[None, :] * K + k[:, None], mask=b_mask, other=0.0)
            else:
                b = tl.load(b_desc + k[:, None] * N + cols[None, :], mask=b_mask, other=0.0)
        else:
            a = a_desc.load([row_start, kt * BLOCK_K])
            if B_NK:
                b = b_desc.load([col_start, kt * BLOCK_K]).T
            else:
                b = b_desc.load([kt * BLOCK_K, col_start])
        if INTERPRETED_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tile_rows(tile, num_mblocks, num_nblocks, group_span, mblocks_ptr, chunk_flags_ptr, epoch, err_addr,
               budget, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """Rows [row_start, row_stop) and first column of ``tile``, after waiting for
    the chunk that brings its rows; the budget left for later waits."""
    mblock, nblock = _grouped_tile(tile, num_mblocks, num_nblocks, group_span, GROUP_M)
    entry = mblocks_ptr + mblock * MBLOCK_COLUMNS
    row_start = tl.load(entry + MBLOCK_START)
    row_stop = tl.load(entry + MBLOCK_STOP)
    flag = tl.load(entry + MBLOCK_FLAG)
    if flag >= 0:
        src = tl.load(entry + MBLOCK_SRC)
        # (This rank's own flag, set once its copy of the rows is in: no word to check.)
        arrived = wait_flag(
            chunk_flags_ptr + flag, epoch, err_addr, budget, src, flag, chunk_flags_ptr, 0,
            FAST_SIGNALS,
        )  # fmt: skip
        # After one timeout this program's later waits fail at once: the
        # output is garbage anyway and the host raises.
        budget = tl.where(arrived, budget, 0)
    return row_start, row_stop, nblock * BLOCK_N, budget


@triton.jit
def _store_tile(c_ptr, row_start, row_stop, col_start, N, stride_cm, acc,
                ROWS: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED_BF16: tl.constexpr):  # fmt: skip
    """Round ``acc`` [ROWS, BLOCK_N] and store it as rows from ``row_start`` (none
    at or past ``row_stop``) and columns from ``col_start`` of C."""
    rows = row_start + tl.arange(0, ROWS)
    cols = col_start + tl.arange(0, BLOCK_N)
    mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, round_output(acc, c_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


@triton.jit
def store_block(c_desc, c_ptr, row_start, row_stop, col_start, N, stride_cm, acc,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_EPILOGUE: tl.constexpr,
                INTERPRETED_BF16: tl.constexpr):  # fmt: skip
    """Store a whole tile's ``acc``: by TMA where the block is whole (module
    docstring), else by pointers."""
    if TMA_EPILOGUE and row_stop - row_start == BLOCK_M:
        c_desc.store(
            [row_start, col_start], round_output(acc, c_ptr.dtype.element_ty, INTERPRETED_BF16)
        )
    else:
        _store_tile(
            c_ptr,
            row_start,
            row_stop,
            col_start,
            N,
            stride_cm,
            acc,
            BLOCK_M,
            BLOCK_N,
            INTERPRETED_BF16,
        )


@triton.jit
def _sum_pieces(partials_ptr, first_slot, slot_stride, pieces, c_ptr, row_start, row_stop, col_start, N, stride_cm,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, INTERPRETED_BF16: tl.constexpr):  # fmt: skip
    """Store the sum of a split tile's ``pieces`` fp32 partial sums (scratch slots
    first_slot, first_slot + slot_stride, ...), ROWS rows at a time: a second
    whole tile of registers beside the accumulator would spill."""
    cols = tl.arange(0, BLOCK_N)
    for first in tl.static_range(0, BLOCK_M, ROWS):
        sub = (first + tl.arange(0, ROWS))[:, None] * BLOCK_N + cols[None, :]
        total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for piece in range(pieces):
            total += tl.load(
                partials_ptr + (first_slot + piece * slot_stride) * (BLOCK_M * BLOCK_N) + sub
            )
        _store_tile(
            c_ptr,
            row_start + first,
            row_stop,
            col_start,
            N,
            stride_cm,
            total,
            ROWS,
            BLOCK_N,
            INTERPRETED_BF16,
        )


@triton.jit
def _push_rows(src_ptr, num_bytes, peer_table_ptr, dst_offset, rank, world, counter_ptr, flag0, flag_stride,
               chunk_flags_ptr, epoch_arg, epoch, err_addr, budget, word, NUM_PROGRAMS: tl.constexpr,
               WORDS: tl.constexpr, FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """Pushed rows (module docstring): copy this program's share of ``num_bytes``
    at ``src_ptr`` to byte ``dst_offset`` of every rank's buffer, count it, and
    (the last program to count: every program has read the epoch) count a
    replayed call (signals.count_replayed_call) and signal every rank with the
    call's signature ``word`` (signals.py); then wait for every source's rows. Returns the budget left. Byte counts and offsets are multiples of 16
    (rows TMA reads), so shares move in 16-byte vectors: whole blocks unmasked,
    then one masked block at a share's end."""
    src_words = tl.multiple_of(src_ptr.to(tl.pointer_type(tl.int32)), 16)  # (the caller's promise)
    num_words = num_bytes // 4
    share = tl.cdiv(tl.cdiv(num_words, NUM_PROGRAMS), WORDS) * WORDS
    first = tl.program_id(0) * share
    last = tl.minimum(first + share, num_words)
    whole = first + tl.maximum(last - first, 0) // WORDS * WORDS
    dst_word = tl.multiple_of(dst_offset // 4, 4)
    for w in range(first, whole, WORDS):
        offs = tl.multiple_of(w, WORDS) + tl.arange(0, WORDS)
        words = tl.load(src_words + offs)
        for dst in range(world):
            tl.store(words_at(peer_table_ptr, dst) + dst_word + offs, words)
    if whole < last:
        offs = whole + tl.arange(0, WORDS)
        words = tl.load(src_words + offs, mask=offs < last)
        for dst in range(world):
            tl.store(words_at(peer_table_ptr, dst) + dst_word + offs, words, mask=offs < last)
    tl.debug_barrier()  # every thread's stores are issued before the count
    # signals.py ordering, as the producer GEMM counts its tiles (kernels/reduce_gemm.py).
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys") == NUM_PROGRAMS - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # for the next launch
        count_replayed_call(epoch_arg, epoch, chunk_flags_ptr)
        for dst in range(world):
            post_word(words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD, rank, epoch, word)
        tl.debug_barrier()  # (signals.py: barrier, then the fence)
        release_fence(rank, FAST_SIGNALS)
        for dst in range(world):
            flags = words_at(peer_table_ptr, dst) + CHUNK_FLAGS_WORD
            signal_one(flags + flag0 + rank * flag_stride, epoch, FAST_SIGNALS)
    budget = launch_budget(budget, chunk_flags_ptr)
    for src in range(world):
        slot = flag0 + src * flag_stride
        arrived = wait_flag(
            chunk_flags_ptr + slot, epoch, err_addr, budget, src, slot, chunk_flags_ptr, word,
            FAST_SIGNALS,
        )  # fmt: skip
        gave_up(arrived, chunk_flags_ptr)
        budget = tl.where(arrived, budget, 0)
    return budget


# Values that change from call to call are not specialised on (epoch == 1 would
# otherwise be a kernel of its own, compiled and loaded during a later call).
# (Nor the pushed rows' values: a launch that pushes nothing loads the very
# kernel a call runs: _load.)
@triton.jit(
    do_not_specialize=["group_span", "epoch", "err_addr", "wait_budget", "tail_first_tile",
                       "tail_pieces", "push_bytes", "push_offset", "rank", "world", "word",
                       "half_bytes"]
)  # fmt: skip
def chunked_gemm_kernel(
    # operands: A [M, K] row-major, B [K, N] (stored [N, K] when B_NK), C [M, N]
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_cm,
    # tile order and the flags that gate it
    mblocks_ptr,  # int32 [num_mblocks, MBLOCK_COLUMNS]
    num_mblocks,
    group_span,  # no tile group crosses a multiple of this many m-blocks (_grouped_tile)
    chunk_flags_ptr,  # int32 chunk flags of this rank
    epoch,
    err_addr,
    wait_budget,
    # the split tail (module docstring): tiles from tail_first_tile on are split along K
    tail_first_tile,  # == the number of tiles: no split tail
    tail_pieces,  # K pieces per tail tile (tail tiles * pieces <= NUM_PROGRAMS)
    tail_partials_ptr,  # fp32 [NUM_PROGRAMS, BLOCK_M, BLOCK_N]: one piece's sum per program
    tail_counters_ptr,  # int32 [NUM_PROGRAMS], zero between launches: pieces stored, per tail tile
    # pushed rows (module docstring; PUSH_ROWS only): this rank's rows, into every rank's buffer
    push_src_ptr,  # this rank's rows, contiguous
    push_bytes,
    peer_table_ptr,  # int64 [world]: every rank's buffer base
    push_offset,  # byte offset of this rank's rows in every rank's buffer
    rank,
    world,
    push_counter_ptr,  # int32, zero between launches: programs whose share is pushed
    push_flag0,  # chunk-flag slot of source 0's rows; source s's: push_flag0 + s * push_flag_stride
    push_flag_stride,
    word,  # the call's signature word: its pushes carry it, their waits check it (signals.py)
    half_bytes,  # pushed rows: A and push_offset move by this much for odd epochs (signals.half_offset)
    # tuning
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    B_NK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FAST_SIGNALS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,  # bf16 in Triton's interpreter: see launch_chunked_gemm
    SUM_ROWS: tl.constexpr,  # rows per step when a split tile's pieces are added
    TMA_EPILOGUE: tl.constexpr,  # whole blocks stored by TMA (module docstring)
    PUSH_ROWS: tl.constexpr,  # push this rank's rows first (module docstring)
    PUSH_WORDS: tl.constexpr,  # int32 words per program per copy step
    POINTER_LOADS: tl.constexpr,  # operands read by masked loads, not TMA (config ``loads``)
):
    epoch_arg = epoch
    epoch = call_epoch(epoch, chunk_flags_ptr)  # (a call replayed in a CUDA graph reads its own)
    if PUSH_ROWS:  # (A is the gathered buffer: in the epoch's half)
        half = half_offset(epoch, half_bytes)
        a_ptr = tl.multiple_of(a_ptr + half // (a_ptr.dtype.element_ty.primitive_bitwidth // 8), 16)
        push_offset += half
    a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_NK,
                                         POINTER_LOADS)  # fmt: skip
    c_desc = c_ptr  # (unused by the pointer epilogue)
    if TMA_EPILOGUE:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
    num_nblocks = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_mblocks * num_nblocks
    budget = wait_budget
    if PUSH_ROWS:
        budget = _push_rows(push_src_ptr, push_bytes, peer_table_ptr, push_offset, rank, world, push_counter_ptr,
                            push_flag0, push_flag_stride, chunk_flags_ptr, epoch_arg, epoch, err_addr, budget,
                            word, NUM_PROGRAMS, PUSH_WORDS, FAST_SIGNALS)  # fmt: skip
    # Whole tiles, round-robin. Not software-pipelined (only the K loop is): the
    # wait in _tile_rows must stay ahead of every load of its tile.
    for tile in range(tl.program_id(0), tail_first_tile, NUM_PROGRAMS):
        row_start, row_stop, col_start, budget = _tile_rows(
            tile, num_mblocks, num_nblocks, group_span, mblocks_ptr, chunk_flags_ptr, epoch, err_addr,
            budget, GROUP_M, BLOCK_N, FAST_SIGNALS,
        )  # fmt: skip
        acc = tile_product(
            a_desc, b_desc, row_start, col_start, 0, k_tiles, M, N, K,
            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, B_NK, INPUT_PRECISION, INTERPRETED_BF16, POINTER_LOADS,
        )  # fmt: skip
        store_block(c_desc, c_ptr, row_start, row_stop, col_start, N, stride_cm, acc,
                    BLOCK_M, BLOCK_N, TMA_EPILOGUE, INTERPRETED_BF16)  # fmt: skip
    # The split tail: each of the last short wave's tiles in tail_pieces K
    # pieces, one per program, piece-major so that the programs of one piece
    # read the same K columns together (L2 reuse, as in a whole-tile wave).
    # Every piece stores its fp32 sum and counts in the tile's counter; the
    # last to count adds the pieces and stores the tile. Nobody waits for
    # anybody, so no program order can deadlock.
    tail_tiles = num_tiles - tail_first_tile
    unit = tl.program_id(0)
    if unit < tail_tiles * tail_pieces:
        piece = unit // tail_tiles
        tail_tile = unit % tail_tiles
        row_start, row_stop, col_start, budget = _tile_rows(
            tail_first_tile + tail_tile, num_mblocks, num_nblocks, group_span, mblocks_ptr, chunk_flags_ptr,
            epoch, err_addr, budget, GROUP_M, BLOCK_N, FAST_SIGNALS,
        )  # fmt: skip
        acc = tile_product(
            a_desc, b_desc, row_start, col_start, piece * k_tiles // tail_pieces, (piece + 1) * k_tiles // tail_pieces,
            M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, B_NK, INPUT_PRECISION, INTERPRETED_BF16, POINTER_LOADS,
        )  # fmt: skip
        slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(tail_partials_ptr + unit * (BLOCK_M * BLOCK_N) + slot, acc)
        tl.debug_barrier()  # every thread's stores are issued before the release
        if (
            tl.atomic_add(tail_counters_ptr + tail_tile, 1, sem="acq_rel", scope="gpu")
            == tail_pieces - 1
        ):
            tl.atomic_xchg(
                tail_counters_ptr + tail_tile, 0, sem="relaxed", scope="gpu"
            )  # for the next launch
            tl.debug_barrier()  # the acquire orders every thread's loads below
            _sum_pieces(tail_partials_ptr, tail_tile, tail_tiles, tail_pieces, c_ptr, row_start, row_stop, col_start,
                        N, stride_cm, BLOCK_M, BLOCK_N, SUM_ROWS, INTERPRETED_BF16)  # fmt: skip


def input_precision(
    config: TileConfig,
) -> str:
    """tl.dot's precision: exact fp32 unless the config allows TF32 (bf16/fp16 ignore it)."""
    return "tf32" if config.allow_tf32 else "ieee"


def interpreted_bf16(dtype: torch.dtype) -> bool:
    """triton 3.6's interpreter computes bf16 dots wrongly and truncates when it
    rounds to bf16; fp32 operands give the same products (bf16 x bf16 is exact
    in fp32) and round_output rounds by bits."""
    return INTERPRETER and dtype == torch.bfloat16


def core_launch_args(
    a: torch.Tensor,
    b: torch.Tensor,
    config: EpilogueConfig,
    fast_signals: bool,
) -> tuple[torch.Tensor, dict]:
    """What every launch of a kernel built on :func:`tile_product` passes alike:
    B as the kernel reads it (the [N, K] base of a ``weight.t()``), and the
    GEMM core's constexprs and warps. Sets up the descriptor allocator on CUDA."""
    if a.device.type == "cuda":
        ensure_descriptor_allocator()
    b_nk = b.stride(0) == 1  # the transpose of an [N, K] row-major weight (nn.Linear layout)
    options = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "NUM_STAGES": config.num_stages,
        "B_NK": b_nk,
        "INPUT_PRECISION": input_precision(config),
        "FAST_SIGNALS": fast_signals,
        "INTERPRETED_BF16": interpreted_bf16(a.dtype),
        "POINTER_LOADS": config.loads == "pointer",
        "num_warps": config.num_warps,
    }
    return (b.t() if b_nk else b), options


def chunk_mblocks(spans: list[tuple[int, int, int, int]], block_m: int) -> int:
    """M-blocks per span of ``spans`` (as :func:`mblock_table` takes them) where every
    span with rows has the same number, else all of them (the kernel's ``group_span``;
    an empty span has no M-block in the table)."""
    counts = [-(-(stop - start) // block_m) for start, stop, _, _ in spans]
    sizes = {count for count in counts if count}
    return sizes.pop() if len(sizes) == 1 else max(1, sum(counts))


def mblock_table(
    spans: list[tuple[int, int, int, int]], block_m: int, device: torch.device | str
) -> torch.Tensor:
    """The M-block table for ``spans`` = [(row start, row stop, flag slot or -1, source)]
    in arrival order: each span cut into blocks of ``block_m`` rows."""
    rows = []
    for start, stop, flag, src in spans:
        for block_start in range(start, stop, block_m):
            rows.append((block_start, min(block_start + block_m, stop), flag, src))
    if not rows:
        rows.append((0, 0, -1, 0))  # keeps the table non-empty; a zero-row block stores nothing
    return torch.tensor(rows, dtype=torch.int32, device=device)


# A tail tile is cut in at most this many K pieces: each piece costs one fp32
# tile stored and read back, and a piece must keep a K loop worth pipelining.
MAX_TAIL_PIECES = 4


def split_tail(num_tiles: int, programs: int, k_tiles: int) -> tuple[int, int]:
    """(first tile of the split tail, K pieces per tail tile). The tail is the
    last short wave; its tiles are cut into as many K pieces as the programs
    can take at once. (num_tiles, 1) when the waves come out even or the wave
    is too full for two pieces a tile."""
    short_wave = num_tiles % programs
    pieces = min(programs // short_wave, MAX_TAIL_PIECES, k_tiles) if short_wave else 1
    if pieces < 2:
        return num_tiles, 1
    return num_tiles - short_wave, pieces


def last_wave_fill(num_tiles: int, programs: int) -> float:
    """The share of ``programs`` persistent programs busy in the last wave of ``num_tiles``
    tiles, 1.0 when the waves come out even; counted before a split tail cuts that wave."""
    short_wave = num_tiles % programs
    return short_wave / programs if short_wave else 1.0


_TAIL_SCRATCH: dict = {}


def tail_scratch(
    device: torch.device, programs: int, tile_elems: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split tail's fp32 partial sums (one tile per program) and its counters
    (zero between launches), one pair per (device, current stream): launches on
    one stream run one after another, so they may share it."""
    # Triton's own current-stream query: a raw handle, without torch's Stream object
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    partials, counters = _TAIL_SCRATCH.get(key, (None, None))
    if partials is None or partials.numel() < programs * tile_elems or counters.numel() < programs:
        partials, counters = _TAIL_SCRATCH[key] = new_tail_scratch(device, programs, tile_elems)
    return partials, counters


def new_tail_scratch(
    device: torch.device, programs: int, tile_elems: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split tail's scratch of its own (:func:`tail_scratch`), for up to ``programs`` programs."""
    return (torch.empty(programs * tile_elems, dtype=torch.float32, device=device),
            torch.zeros(programs, dtype=torch.int32, device=device))  # fmt: skip


def launch_chunked_gemm(
    a: torch.Tensor,  # [M, K] row-major
    b: torch.Tensor,  # [K, N]: row-major, or the transpose of a row-major [N, K]
    out: torch.Tensor,  # [M, N] row-major
    mblocks: torch.Tensor,
    config: ChunkedGemmConfig,
    num_programs: int,
    *,
    chunk_flags: torch.Tensor | None = None,
    epoch: int = 0,
    err_addr: int = 0,
    wait_budget: int = 0,
    fast_signals: bool = False,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    push: PushedRows | None = None,
    push_src: torch.Tensor | None = None,
    word: int = 0,
    group_span: int | None = None,
    half_bytes: int = 0,
) -> ChunkedGemmRelaunch | None:
    """Launch :func:`chunked_gemm_kernel` (operand layouts checked by the caller;
    with ``config.epilogue == "tma"`` also ``out``'s alignment: ops.checks.resolve_epilogue);
    the :class:`ChunkedGemmRelaunch` of it where there is one. The split tail
    uses ``scratch`` (:func:`new_tail_scratch`, for ``num_programs``) where
    given, else the current stream's. With ``push``, the kernel first pushes
    ``push_src`` (this rank's rows, contiguous, 16-byte aligned) as :class:`PushedRows` says,
    with the call's signature ``word`` (runtime/signals.py). Tile groups do not cross
    a multiple of ``group_span`` m-blocks (:func:`chunk_mblocks`; None: they run on
    across the whole table). ``half_bytes``: a pushing launch that picks its buffer
    half by the epoch's parity (a replayed call) gives the bytes between the halves."""
    b_base, core = core_launch_args(a, b, config, fast_signals)
    M, K = a.shape
    N = b.shape[1]
    num_tiles = mblocks.shape[0] * triton.cdiv(N, config.block_n)
    num_programs = max(1, num_programs)  # (the interpreter has 4 "SMs": comm_sms may take them all)
    if push is not None and INTERPRETER:
        num_programs = 1  # (module docstring: pushed rows)
    flags = chunk_flags
    if chunk_flags is None:  # nothing waited on: any epoch but DEVICE_EPOCH, which reads a flag
        flags, epoch = mblocks, DEVICE_EPOCH + 1
    tail_first_tile, tail_pieces = num_tiles, 1
    if config.split_tail:
        tail_first_tile, tail_pieces = split_tail(
            num_tiles, num_programs, triton.cdiv(K, config.block_k)
        )
    if num_tiles >= num_programs:
        programs = num_programs
    else:  # one short wave: a program per tile, or per piece when the tiles are split
        programs = max(1, num_tiles * tail_pieces)
    # (Passed even when there is no tail: one compiled kernel for both cases.)
    tile_elems = config.block_m * config.block_n
    partials, counters = (
        scratch if scratch is not None else tail_scratch(a.device, programs, tile_elems)
    )
    args = (
        a, b_base, out, M, N, K, out.stride(0),
        mblocks, mblocks.shape[0], group_span or mblocks.shape[0], flags, epoch, err_addr, wait_budget,
        tail_first_tile, tail_pieces, partials, counters,
        *(push.args(push_src) if push is not None else _no_push(a, mblocks)), word, half_bytes,
    )  # fmt: skip
    kwargs = dict(GROUP_M=config.group_m, NUM_PROGRAMS=programs, SUM_ROWS=min(16, config.block_m),
                  TMA_EPILOGUE=config.epilogue == "tma", PUSH_ROWS=push is not None,
                  PUSH_WORDS=_PUSH_WORDS, **core)  # fmt: skip
    if (
        push is not None
        and a.device.type == "cuda"
        and not torch.cuda.is_current_stream_capturing()
    ):
        _load(args, kwargs, programs)  # (a capture's kernel is the one its eager call loaded)
    again = launch(chunked_gemm_kernel, (programs,), args, kwargs, a.device)
    return (
        None
        if again is None
        # (No split tail: the kernel never reads the scratch, so a relaunch keeps the first one's.)
        else ChunkedGemmRelaunch(
            again, programs, tile_elems, scratch is not None or tail_pieces == 1
        )
    )


# int32 words each program moves per step when it pushes rows: 8 KiB, 32 bytes
# per thread of 8 warps (two 16-byte vectors).
_PUSH_WORDS = 2048


def _no_push(a: torch.Tensor, mblocks: torch.Tensor) -> tuple:
    """The push arguments of a launch that pushes nothing (PUSH_ROWS off: unused)."""
    return (a, 0, mblocks, 0, 0, 0, mblocks, 0, 0)


def _load(args: tuple, kwargs: dict, programs: int) -> None:
    """Launch the kernel a pushing call runs with nothing to do (no tiles, no
    rank to push to or wait for) and wait for it: its module is then loaded
    before the call's launch, whose peers wait for its pushes (a module load
    waits for the kernels running on the device; ranks sharing a GPU would
    wait on each other's loads)."""
    idle = list(args)
    for name in ("tail_first_tile", "tail_pieces", "world"):
        idle[chunked_gemm_kernel.arg_names.index(name)] = 0
    chunked_gemm_kernel[(programs,)](*idle, **kwargs)
    torch.cuda.synchronize(args[0].device)


@dataclass(frozen=True)
class PushedRows:
    """What a launch that pushes this rank's rows first needs (module docstring,
    pushed rows): every rank's buffer base, where this rank's rows go in each,
    the programs' count, and the flag slots of the sources' rows."""

    peer_table: torch.Tensor  # int64 [world]
    offset: int  # byte offset of this rank's rows in every rank's buffer
    rank: int
    world: int
    counter: torch.Tensor  # int32 [1], zero between launches
    flag0: int  # chunk-flag slot of source 0's rows
    flag_stride: int  # source s's slot: flag0 + s * flag_stride

    def args(self, src: torch.Tensor) -> tuple:
        return (src, src.numel() * src.element_size(), self.peer_table, self.offset, self.rank,
                self.world, self.counter, self.flag0, self.flag_stride)  # fmt: skip


class ChunkedGemmRelaunch:
    """A chunked GEMM launch made again for a call of the same plan: only the
    operands, ``out`` and the epoch change (and the split tail's scratch where
    it is the current stream's). ``out`` must have the first launch's row
    stride and epilogue; the caller keys its relaunches by them."""

    def __init__(self, again: Relaunch, programs: int, tile_elems: int, own_scratch: bool):
        self.again, self.programs, self.tile_elems, self.own_scratch = (
            again,
            programs,
            tile_elems,
            own_scratch,
        )
        # (stream, partials, counters): the split tail's scratch the last launch passed,
        # held so that its addresses, which the relaunch keeps passing, stay valid.
        self._held_tail: tuple | None = None
        self._current_stream = driver.active.get_current_stream

    def __call__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        epoch: int | None = None,
        launch_scratch=None,
        push_src: torch.Tensor | None = None,
        word: int | None = None,
    ) -> bool:
        """Launch on the current stream (``epoch``: the first launch's where None); False
        (nothing launched) where the relaunch cannot take these tensors.
        ``launch_scratch``: Relaunch's ``scratch``; ``push_src``: the rows a pushing
        launch pushes and ``word`` its signature word (each the first launch's where None:
        a plan's first calls, autotune's, may run before its word is set)."""
        changed = {} if epoch is None else {"epoch": epoch}
        if push_src is not None:
            changed["push_src_ptr"] = push_src
        if word is not None:
            changed["word"] = word
        held = None
        stream = self._current_stream(self.again.device_index)
        # (on the stream of the launch before, that launch's scratch serves)
        if not self.own_scratch and (self._held_tail is None or self._held_tail[0] != stream):
            partials, counters = tail_scratch(a.device, self.programs, self.tile_elems)
            changed.update(tail_partials_ptr=partials, tail_counters_ptr=counters)
            held = (stream, partials, counters)
        # b.t() of a weight shares its base: the kernel's B pointer is b's either way.
        launched = self.again(launch_scratch, stream, a_ptr=a, b_ptr=b, c_ptr=out, **changed)
        if launched and held is not None:  # (a declined launch may not have taken them)
            self._held_tail = held
        return launched
