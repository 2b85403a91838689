"""What one rank does for a schedule, a shape and one of the two gathered
buffers: built once, cached in the workspace, so a call does no host-side
work beyond its launches (on small shapes host time is the op's time)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kernels.gemm import PushedRows, chunk_mblocks, mblock_table
from ...limits import DATA_OFFSET, LOCAL_FLAGS, writer_flags
from ...runtime.workspace import Workspace
from ...schedules import COPY_ENGINE, LOCAL, PUSH, SM_COPY, ChunkSchedule


@dataclass(frozen=True)
class CopyEngineStep:
    dst: torch.Tensor  # rows of this rank's gathered buffer
    src: torch.Tensor  # the same rows of the source rank's buffer (a peer view)
    flag: int  # chunk-flag slot set after the copy


@dataclass(frozen=True)
class TransferPlan:
    gathered: torch.Tensor  # [M, K] this rank's gathered buffer (symmetric memory)
    # The schedule's chunks in order, as (row start, row stop, index of the
    # copy-engine step that brings them or -1): the cuBLAS consumer's walk.
    chunk_rows: tuple[tuple[int, int, int], ...]
    # CUDA: one event per copy-engine step, recorded after its copy when the
    # consumer is cuBLAS (which waits on events, not flags). None on CPU.
    arrived: tuple | None
    own_rows: torch.Tensor  # this rank's rows of it: where x is published
    buffer_offset: int  # byte offset of the gathered buffer from each rank's base
    mblocks: torch.Tensor  # int32 M-block table: the GEMM's tile order (kernels/gemm.py)
    chunk_mblocks: int  # M-blocks of each chunk where all have as many, else of all (gemm.py)
    copy_engine_steps: tuple[CopyEngineStep, ...]
    copy_engine_sources: torch.Tensor  # int32: ranks whose ready flag the copy engine waits for
    sm_chunks: torch.Tensor  # int64 [n, 4]: src, byte start, byte stop, flag (kernels/transfer.py)
    num_sm_chunks: int
    sm_counters: (
        torch.Tensor
    )  # int32 [num_sm_chunks]: the pull kernel's programs done with each chunk
    # Config mechanism "push": the GEMM pushes this rank's rows to every rank first
    # (kernels/gemm.py), and its tiles walk the gathered rows in row order.
    push: PushedRows | None = None
    # "announce" -> the ready-flag exchange's launch made again; (a caller's
    # token, epilogue, out's row stride) -> the GEMM's (kernels/relaunch.py)
    relaunches: dict = field(default_factory=dict, compare=False)


def make_plan(
    ws: Workspace, schedule: ChunkSchedule, x: torch.Tensor, buffer_offset: int, block_m: int
) -> TransferPlan:
    m_local, k = x.shape
    key = ("ag_gemm", schedule, m_local, k, x.dtype, buffer_offset, block_m)
    plan = ws.cache.get(key)
    if plan is None:
        plan = ws.cache[key] = _build(ws, schedule, m_local, k, x.dtype, buffer_offset, block_m)
    return plan


def _build(ws, schedule, m_local, k, dtype, buffer_offset, block_m) -> TransferPlan:
    shape = (m_local * ws.world, k)
    gathered = ws.data(ws.rank, buffer_offset, shape, dtype)
    row_bytes = k * dtype.itemsize
    if schedule.mechanisms == {PUSH}:
        return _build_pushed(ws, gathered, m_local, row_bytes, buffer_offset, block_m)
    spans, chunk_rows, copy_engine_steps, sm_copy_chunks = [], [], [], []
    for chunk in schedule.for_rank(ws.rank):
        start, stop = chunk.rows(m_local)
        spans.append((start, stop, -1 if chunk.mechanism == LOCAL else chunk.flag, chunk.src))
        chunk_rows.append(
            (start, stop, len(copy_engine_steps) if chunk.mechanism == COPY_ENGINE else -1)
        )
        if chunk.mechanism == COPY_ENGINE:
            peer = ws.data(chunk.src, buffer_offset, shape, dtype)
            step = CopyEngineStep(gathered[start:stop], peer[start:stop], chunk.flag)
            copy_engine_steps.append((chunk.src, step))
        elif chunk.mechanism == SM_COPY:
            sm_copy_chunks.append((chunk.src, start * row_bytes, stop * row_bytes, chunk.flag))
    sources = list(dict.fromkeys(src for src, _ in copy_engine_steps))
    device = ws.device
    on_cuda = device.type == "cuda"
    return TransferPlan(
        gathered=gathered,
        chunk_rows=tuple(chunk_rows),
        arrived=tuple(torch.cuda.Event() for _ in copy_engine_steps) if on_cuda else None,
        own_rows=gathered[ws.rank * m_local : (ws.rank + 1) * m_local],
        buffer_offset=DATA_OFFSET + buffer_offset,
        mblocks=mblock_table(spans, block_m, device),
        chunk_mblocks=chunk_mblocks(spans, block_m),
        copy_engine_steps=tuple(step for _, step in copy_engine_steps),
        copy_engine_sources=torch.tensor(sources or [0], dtype=torch.int32, device=device),
        sm_chunks=torch.tensor(sm_copy_chunks or [(0, 0, 0, 0)], dtype=torch.int64, device=device),
        num_sm_chunks=len(sm_copy_chunks),
        sm_counters=torch.zeros(max(1, len(sm_copy_chunks)), dtype=torch.int32, device=device),
    )


def _build_pushed(
    ws: Workspace,
    gathered: torch.Tensor,
    m_local: int,
    row_bytes: int,
    buffer_offset: int,
    block_m: int,
) -> TransferPlan:
    """Mechanism "push": no transfer of its own; source s's rows announced by
    flag W(s) (limits.writer_flags), which only s sets."""
    device, rank, m = ws.device, ws.rank, gathered.shape[0]
    none64 = torch.zeros((1, 4), dtype=torch.int64, device=device)
    return TransferPlan(
        gathered=gathered,
        chunk_rows=((0, m, -1),),
        arrived=None,
        own_rows=gathered[rank * m_local : (rank + 1) * m_local],
        buffer_offset=DATA_OFFSET + buffer_offset,
        mblocks=mblock_table([(0, m, -1, rank)], block_m, device),
        chunk_mblocks=chunk_mblocks([(0, m, -1, rank)], block_m),
        copy_engine_steps=(),
        copy_engine_sources=torch.zeros(1, dtype=torch.int32, device=device),
        sm_chunks=none64,
        num_sm_chunks=0,
        sm_counters=torch.zeros(1, dtype=torch.int32, device=device),
        push=PushedRows(
            peer_table=ws.peer_table,
            offset=DATA_OFFSET + buffer_offset + rank * m_local * row_bytes,
            rank=rank,
            world=ws.world,
            counter=torch.zeros(1, dtype=torch.int32, device=device),
            flag0=LOCAL_FLAGS,
            flag_stride=writer_flags(ws.world),
        ),
    )
