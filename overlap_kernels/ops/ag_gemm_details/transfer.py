"""Steps 1 and 2 of ag_gemm: publish this rank's rows, move peers' rows in."""

from __future__ import annotations

import torch

from ...kernels.transfer import announce_kernel, pull_chunks_kernel, wait_ready_kernel
from ...runtime.platform import FAST_SIGNALS
from ...runtime.workspace import READY_FLAGS_OFFSET, Workspace
from .plan import TransferPlan

# int32 words each SM-copy program moves per loop step: 32 KiB in flight per
# program keeps an NVLink pull near its bandwidth with few SMs.
_COPY_BLOCK_WORDS = 8192


def publish(ws: Workspace, plan: TransferPlan, x: torch.Tensor, epoch: int) -> None:
    """Put x into this rank's rows of the gathered buffer and announce it to every peer."""
    plan.own_rows.copy_(x)
    announce_kernel[(ws.world,)](ws.peer_table, READY_FLAGS_OFFSET, ws.rank, epoch)


def transfer(ws: Workspace, plan: TransferPlan, epoch: int, budget: int, comm_sms: int) -> None:
    """Enqueue every chunk's transfer and flag (call it on the communication stream)."""
    if plan.copy_engine_steps:
        wait_ready_kernel[(1,)](
            ws.ready_flags, plan.copy_engine_sources, plan.copy_engine_sources.numel(),
            epoch, ws.error_address, budget, FAST_SIGNALS,
        )  # fmt: skip
        for step in plan.copy_engine_steps:
            step.dst.copy_(step.src)
            ws.signal_from_stream(step.flag, epoch)
    if plan.num_sm_chunks:
        programs = max(1, min(comm_sms, plan.num_sm_chunks))
        pull_chunks_kernel[(programs,)](
            ws.peer_table, ws.rank, plan.buffer_offset, plan.sm_chunks, plan.num_sm_chunks,
            ws.ready_flags, ws.chunk_flags, epoch, ws.error_address, budget,
            NUM_PROGRAMS=programs, BLOCK_WORDS=_COPY_BLOCK_WORDS, FAST_SIGNALS=FAST_SIGNALS,
        )  # fmt: skip
