"""ag_gemm's steps: publish this rank's rows, move peers' rows in, and (for
the cuBLAS consumer) multiply each chunk as it arrives."""

from __future__ import annotations

import torch

from ...kernels.transfer import enter_replay, exchange_ready, pull_chunks_kernel
from ...limits import DEVICE_EPOCH
from ...runtime.platform import FAST_SIGNALS
from ...runtime.workspace import Workspace
from .plan import TransferPlan

# int32 words each SM-copy program moves per loop step: 32 KiB in flight per
# program, 256 bytes per thread of 4 warps, to keep NVLink pulls busy.
_COPY_BLOCK_WORDS = 8192


def publish(plan: TransferPlan, x: torch.Tensor) -> None:
    """Put x into this rank's rows of the gathered buffer (on the caller's stream)."""
    plan.own_rows.copy_(x)


def announce(ws: Workspace, plan: TransferPlan, epoch: int, budget: int, word: int) -> None:
    """Announce the published rows to every peer and wait for the announcements
    of the ranks the copy engine reads (on the stream that published them), with
    the call's signature ``word``. A replayed call (``epoch`` == DEVICE_EPOCH)
    announces the next device epoch, which its later kernels read (ops/replay.py)."""
    replayed = epoch == DEVICE_EPOCH
    again = plan.relaunches.get("announce")
    if again is not None and (
        again(budget=budget, word=word)
        if replayed
        else again(epoch=epoch, budget=budget, word=word)
    ):
        return
    sources = plan.copy_engine_sources
    count = sources.numel() if plan.copy_engine_steps else 0
    if replayed:
        plan.relaunches["announce"] = enter_replay(ws, sources, count, budget, word)
    else:
        plan.relaunches["announce"] = exchange_ready(ws, epoch, budget, sources, count, word)


def transfer(
    ws: Workspace,
    plan: TransferPlan,
    epoch: int,
    budget: int,
    comm_sms: int,
    by_event: bool,
    word: int,
) -> None:
    """Enqueue every chunk's transfer and its flag, or with ``by_event`` its CUDA
    event (call it on the communication stream, ordered after :func:`announce`);
    SM pulls check each source's announcement for the call's signature ``word``."""
    if plan.copy_engine_steps:
        for i, step in enumerate(plan.copy_engine_steps):
            step.dst.copy_(step.src)
            if not by_event:
                ws.signal_from_stream(step.flag, epoch)
            elif plan.arrived is not None:  # (on CPU the transfers end before the consumer starts)
                plan.arrived[i].record()
    if plan.num_sm_chunks:
        programs = max(
            1, comm_sms
        )  # every program copies a share of every chunk (grid == NUM_PROGRAMS)
        pull_chunks_kernel[(programs,)](
            ws.peer_table, ws.rank, plan.buffer_offset, plan.sm_chunks, plan.num_sm_chunks, plan.sm_counters,
            ws.ready_flags, ws.chunk_flags, epoch, ws.error_address, budget, word,
            NUM_PROGRAMS=programs, BLOCK_WORDS=_COPY_BLOCK_WORDS, FAST_SIGNALS=FAST_SIGNALS,
        )  # fmt: skip


def consume_with_cublas(
    plan: TransferPlan,
    w: torch.Tensor,
    out: torch.Tensor,
    streams: tuple,
    *,
    copy_in_turn: bool = False,
) -> None:
    """out = gathered @ w, one torch.matmul per chunk in the schedule's order, each
    enqueued behind the event of the copy that brings its rows (own rows: none),
    or with ``copy_in_turn`` behind that copy itself, enqueued on the matmul's
    stream (the caller's announcement has already waited for every source).
    Chunk i runs on ``streams[i % len(streams)]`` (the first is the caller's):
    with two, a chunk's first wave starts on the SMs its predecessor's last
    wave leaves idle instead of after it. Call it on the caller's stream after
    :func:`transfer` is enqueued (unless the copies are in turn); on return the
    caller's stream has waited for every chunk. CPU: ``streams`` is empty and
    the chunks run in order."""

    def multiply(start: int, stop: int, step: int) -> None:
        if copy_in_turn and step >= 0:
            copy = plan.copy_engine_steps[step]
            copy.dst.copy_(copy.src)
        torch.matmul(plan.gathered[start:stop], w, out=out[start:stop])

    if not streams:
        for chunk in plan.chunk_rows:
            multiply(*chunk)
        return
    main = streams[0]
    for side in streams[1:]:
        side.wait_stream(main)  # the published rows, the announcement
    for i, (start, stop, step) in enumerate(plan.chunk_rows):
        stream = streams[i % len(streams)]
        if step >= 0 and not copy_in_turn:
            stream.wait_event(plan.arrived[step])
        with torch.cuda.stream(stream):
            multiply(start, stop, step)
    for side in streams[1:]:
        main.wait_stream(side)
