"""Communication kernels: exchange ready flags, set a flag, pull chunks.

They follow the signal contract of runtime/signals.py. Addresses of peers'
buffers come from the workspace's peer table (int64 base address per rank);
``*_offset`` arguments are byte offsets from a rank's base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..limits import CHUNK_FLAGS_OFFSET, DEVICE_EPOCH, READY_FLAGS_OFFSET, REPLAY_EPOCH_SLOT
from ..runtime.platform import FAST_SIGNALS
from ..runtime.signals import (
    call_epoch,
    post_word,
    release_fence,
    signal_one,
    signal_release,
    timed_out_before,
    wait_flag,
    word_for_slot,
)
from .relaunch import Relaunch, launch

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

# Chunk table columns (int64) for the pull kernel: source rank, byte range
# [start, stop) within the gathered buffer, chunk-flag slot.
# (tl.constexpr: kernels may read module globals only when they are constexpr.)
CHUNK_SRC = tl.constexpr(0)
CHUNK_BYTE_START = tl.constexpr(1)
CHUNK_BYTE_STOP = tl.constexpr(2)
CHUNK_FLAG = tl.constexpr(3)
CHUNK_COLUMNS = tl.constexpr(4)
CHUNK_FLAGS_WORD = tl.constexpr(CHUNK_FLAGS_OFFSET // 4)  # a buffer's chunk flags, in int32 words


@triton.jit
def _peer_address(peer_table_ptr, rank, byte_offset):
    # Symmetric buffers are 16-byte aligned on every backend; saying so lets
    # Triton vectorise the copies.
    return tl.multiple_of(tl.load(peer_table_ptr + rank), 16) + byte_offset


@triton.jit
def words_at(peer_table_ptr, rank):
    """Rank ``rank``'s symmetric buffer as int32 words, 16-byte aligned."""
    return tl.multiple_of(tl.load(peer_table_ptr + rank).to(tl.pointer_type(tl.int32)), 16)


@triton.jit
def _announce_then_wait(peer_table_ptr, ready_offset, rank, world, ready_flags_ptr, sources_ptr, num_sources,
                        epoch, err_addr, budget, word, FAST_SIGNALS: tl.constexpr):  # fmt: skip
    """Store ``epoch`` in this rank's ready flag at every rank, with the call's
    signature ``word``, then wait for the ready flags of the first ``num_sources``
    ranks of ``sources``. One fence, then a relaxed write per rank (signals.py):
    their round trips overlap instead of each release waiting for the one before."""
    budget = tl.where(
        timed_out_before(err_addr), 0, budget
    )  # one deadline per call, not one per step
    for peer in range(world):
        post_word(words_at(peer_table_ptr, peer) + CHUNK_FLAGS_WORD, rank, epoch, word)
    tl.debug_barrier()
    release_fence(rank, FAST_SIGNALS)
    for peer in range(world):
        flag = _peer_address(peer_table_ptr, peer, ready_offset + rank * 4).to(
            tl.pointer_type(tl.int32)
        )
        signal_one(flag, epoch, FAST_SIGNALS)
    for i in range(num_sources):
        src = tl.load(sources_ptr + i)
        arrived = wait_flag(ready_flags_ptr + src, epoch, err_addr, budget, src, -1,
                            words_at(peer_table_ptr, rank) + CHUNK_FLAGS_WORD, word, FAST_SIGNALS)  # fmt: skip
        budget = tl.where(arrived, budget, 0)


# Per-call values are not specialised on (see kernels/gemm.py).
@triton.jit(do_not_specialize=["epoch", "err_addr", "budget", "word"])
def exchange_ready_kernel(
    peer_table_ptr,
    ready_offset,
    rank,
    world,
    ready_flags_ptr,
    sources_ptr,
    num_sources,
    epoch,
    err_addr,
    budget,
    word,
    FAST_SIGNALS: tl.constexpr,
):
    """Announce "my rows for this call are in my buffer" to every rank (stream-ordered
    after the copy that put them there), then wait for the announcements of
    ``sources`` (the ranks the copy engine will read; none for SM copies, which
    wait per chunk). One launch for both: on small shapes launches are the cost."""
    _announce_then_wait(peer_table_ptr, ready_offset, rank, world, ready_flags_ptr, sources_ptr, num_sources,
                        epoch, err_addr, budget, word, FAST_SIGNALS)  # fmt: skip


@triton.jit(do_not_specialize=["num_sources", "err_addr", "budget", "word"])
def enter_replay_kernel(
    peer_table_ptr,
    ready_offset,
    rank,
    world,
    ready_flags_ptr,
    sources_ptr,  # int32: the ranks to wait for
    num_sources,
    epoch_ptr,  # the replay workspace's epoch word (limits.REPLAY_EPOCH_SLOT)
    err_addr,
    budget,
    word,
    FAST_SIGNALS: tl.constexpr,
):
    """A step of a fused call in a CUDA graph: count the next epoch on the device
    (a replay repeats the kernel, not a value), announce it in the ready flags,
    and wait for the first ``num_sources`` ranks of ``sources`` to announce it too.

    Its first step waits for every rank: a rank enters a call only once its
    previous call has ended, so no rank writes into a peer's buffer while the
    peer still reads the previous call's data (a replay workspace has one
    buffer, not two halves that alternate). ag_gemm's announcement of its
    published rows is a second step (its ready flags wait for a later epoch
    than the entry's), after which the call's kernels read that epoch."""
    # One atomic, whose result every thread gets: a load and a store would let a
    # thread that loads after another's store count the epoch twice.
    epoch = tl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu") + 1
    _announce_then_wait(peer_table_ptr, ready_offset, rank, world, ready_flags_ptr, sources_ptr, num_sources,
                        epoch, err_addr, budget, word, FAST_SIGNALS)  # fmt: skip


def enter_replay(
    ws: Workspace, sources: torch.Tensor, num_sources: int, budget: int, word: int
) -> Relaunch | None:
    """:func:`enter_replay_kernel` for replay workspace ``ws``, one program, with the
    call's signature ``word``; its Relaunch where there is one."""
    args = (ws.peer_table, READY_FLAGS_OFFSET, ws.rank, ws.world, ws.ready_flags, sources, num_sources,
            ws.chunk_flags[REPLAY_EPOCH_SLOT:], ws.error_address, budget, word, FAST_SIGNALS)  # fmt: skip
    return launch(enter_replay_kernel, (1,), args, {}, ws.device)


def load_wait_kernel(ws: Workspace, budget: int) -> None:
    """Launch :func:`wait_kernel` on the epoch word itself (a wait that returns at
    once, in an eager or a replay workspace): its module loaded before a call
    waits on it, with the call's argument types."""
    args = (
        ws.chunk_flags,
        REPLAY_EPOCH_SLOT,
        DEVICE_EPOCH,
        ws.error_address,
        budget,
        0,
        0,
        FAST_SIGNALS,
    )
    wait_kernel[(1,)](*args)


def exchange_ready(
    ws: Workspace, epoch: int, budget: int, sources: torch.Tensor, num_sources: int, word: int
) -> Relaunch | None:
    """Announce that workspace ``ws``'s buffer half holds ``epoch``'s data, then
    wait for the announcements of the first ``num_sources`` ranks of ``sources``
    (int32, on the device), all with the call's signature ``word``:
    :func:`exchange_ready_kernel`, one program; its :class:`Relaunch` (``epoch``,
    ``budget`` and ``word`` may change) where there is one."""
    args = (ws.peer_table, READY_FLAGS_OFFSET, ws.rank, ws.world, ws.ready_flags, sources, num_sources,
            epoch, ws.error_address, budget, word, FAST_SIGNALS)  # fmt: skip
    return launch(exchange_ready_kernel, (1,), args, {}, ws.device)


@triton.jit(do_not_specialize=["slot", "epoch", "err_addr", "budget", "peer", "word"])
def wait_kernel(flags_ptr, slot, epoch, err_addr, budget, peer, word, FAST_SIGNALS: tl.constexpr):
    """Hold the stream until flag ``slot`` of this rank's chunk flags holds the
    call's epoch (signals.call_epoch), set by ``peer`` with the call's signature
    ``word``: gates a copy-engine copy of data that a peer's kernel produces.
    After an earlier failure it returns at once (the first is the one reported)."""
    if not timed_out_before(err_addr):
        wait_flag(
            flags_ptr + slot,
            call_epoch(epoch, flags_ptr),
            err_addr,
            budget,
            peer,
            slot,
            flags_ptr,
            word_for_slot(slot, word),
            FAST_SIGNALS,
        )


@triton.jit(do_not_specialize=["epoch", "err_addr", "budget", "word"])
def pull_chunks_kernel(
    peer_table_ptr,
    rank,
    buffer_offset,  # byte offset of the gathered buffer in every rank's symmetric memory
    chunks_ptr,  # int64 [num_chunks, CHUNK_COLUMNS]
    num_chunks,
    counters_ptr,  # int32 [num_chunks], zero between launches: programs done with each chunk
    ready_flags_ptr,
    chunk_flags_ptr,
    epoch,
    err_addr,
    budget,
    word,  # the call's signature word, checked against each source's announcement
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    FAST_SIGNALS: tl.constexpr,
):
    """SM copies: every program copies its share of every chunk, chunks in
    the schedule's order, from the source rank's buffer into this rank's; the program
    that finishes a chunk's last share releases the chunk's flag. Shares, not
    whole chunks per program: a call has about as many chunks as peers, so
    whole chunks would leave all but that many programs idle.

    Chunks start at whole rows, and the fused path's rows are 16-byte aligned
    (TMA), so shares move in 16-byte vectors: whole blocks unmasked, then one
    masked block at a share's end.

    A chunk whose source never announced is still released (with garbage) so
    that no consumer hangs; the timeout is in the error record, and a program
    that finds one there waits no more (the interpreter runs the programs one
    after another). The grid must be NUM_PROGRAMS programs: the last of them
    to count a chunk releases it.
    """
    epoch = call_epoch(epoch, chunk_flags_ptr)
    for c in range(num_chunks):
        entry = chunks_ptr + c * CHUNK_COLUMNS
        src = tl.load(entry + CHUNK_SRC).to(tl.int32)
        byte_start = tl.load(entry + CHUNK_BYTE_START)
        byte_stop = tl.load(entry + CHUNK_BYTE_STOP)
        slot = tl.load(entry + CHUNK_FLAG).to(tl.int32)
        budget = tl.where(timed_out_before(err_addr), 0, budget)
        arrived = wait_flag(ready_flags_ptr + src, epoch, err_addr, budget, src, slot, chunk_flags_ptr,
                            word, FAST_SIGNALS)  # fmt: skip
        budget = tl.where(arrived, budget, 0)
        # Alignment said of the pointers themselves (an integer's is lost in the cast).
        # Buffer offsets are 256-byte aligned (runtime/workspace.py).
        chunk_words = tl.multiple_of((buffer_offset + byte_start) // 4, 4)
        src_words = words_at(peer_table_ptr, src) + chunk_words
        dst_words = words_at(peer_table_ptr, rank) + chunk_words
        num_words = (byte_stop - byte_start) // 4
        share = tl.cdiv(tl.cdiv(num_words, NUM_PROGRAMS), BLOCK_WORDS) * BLOCK_WORDS
        first = tl.program_id(0) * share
        last = tl.minimum(first + share, num_words)
        whole = first + tl.maximum(last - first, 0) // BLOCK_WORDS * BLOCK_WORDS
        for w in range(first, whole, BLOCK_WORDS):
            offs = tl.multiple_of(w, BLOCK_WORDS) + tl.arange(0, BLOCK_WORDS)
            tl.store(dst_words + offs, tl.load(src_words + offs))
        if whole < last:
            offs = whole + tl.arange(0, BLOCK_WORDS)
            tl.store(
                dst_words + offs, tl.load(src_words + offs, mask=offs < last), mask=offs < last
            )
        tl.debug_barrier()  # every thread's stores are issued before the count
        if tl.atomic_add(counters_ptr + c, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1:
            tl.atomic_xchg(counters_ptr + c, 0, sem="relaxed", scope="gpu")  # for the next launch
            signal_release(chunk_flags_ptr + slot, epoch)
