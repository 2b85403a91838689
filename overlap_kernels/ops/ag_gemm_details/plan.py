"""What one rank does for a schedule and a shape, built once and cached in the workspace."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.gemm import mblock_table
from ...runtime.workspace import Workspace
from ...schedules import COPY_ENGINE, LOCAL, SM_COPY, ChunkSchedule


@dataclass(frozen=True)
class TransferPlan:
    mblocks: torch.Tensor  # int32 M-block table: the GEMM's tile order (kernels/gemm.py)
    copy_engine_chunks: tuple[tuple[int, int, int, int], ...]  # (src, row start, row stop, flag)
    copy_engine_sources: torch.Tensor  # int32: ranks whose ready flag the copy engine waits for
    sm_chunks: torch.Tensor  # int64 [n, 4]: src, byte start, byte stop, flag (kernels/transfer.py)
    num_sm_chunks: int


def make_plan(
    ws: Workspace, schedule: ChunkSchedule, m_local: int, k: int, itemsize: int, block_m: int
) -> TransferPlan:
    key = ("ag_gemm", schedule, m_local, k, itemsize, block_m)
    plan = ws.cache.get(key)
    if plan is None:
        plan = ws.cache[key] = _build(ws, schedule.for_rank(ws.rank), m_local, k * itemsize, block_m)
    return plan


def _build(ws: Workspace, chunks, m_local: int, row_bytes: int, block_m: int) -> TransferPlan:
    spans, ce, sm = [], [], []
    for chunk in chunks:
        start, stop = chunk.rows(m_local)
        flag = -1 if chunk.mechanism == LOCAL else chunk.flag
        spans.append((start, stop, flag, chunk.src))
        if chunk.mechanism == COPY_ENGINE:
            ce.append((chunk.src, start, stop, chunk.flag))
        elif chunk.mechanism == SM_COPY:
            sm.append((chunk.src, start * row_bytes, stop * row_bytes, chunk.flag))
    sources = list(dict.fromkeys(src for src, *_ in ce))
    device = ws.device
    return TransferPlan(
        mblocks=mblock_table(spans, block_m, device),
        copy_engine_chunks=tuple(ce),
        copy_engine_sources=torch.tensor(sources or [0], dtype=torch.int32, device=device),
        sm_chunks=torch.tensor(sm or [(0, 0, 0, 0)], dtype=torch.int64, device=device),
        num_sm_chunks=len(sm),
    )
