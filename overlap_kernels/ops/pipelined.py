"""The pipelined path of ag_gemm, gemm_rs and gemm_ar: the GEMM in row chunks
on the caller's stream (torch.matmul, i.e. cuBLAS) and each chunk's NCCL
collective beside another chunk's GEMM.
  gemm_rs, gemm_ar  a chunk's reduce-scatter / all-reduce starts as soon as
                    its rows are computed and runs beside the next chunk's
                    GEMM: the last chunk's collective is not hidden.
  ag_gemm           every chunk's all-gather is enqueued at once; this rank's
                    own rows (which need no gather) are multiplied meanwhile,
                    then each gathered chunk as it arrives: the GEMM of the
                    last chunk's peer rows is not hidden.

Where it pays: products too large for one_shot whose fused kernels lose to
this (templates/gemm_ar.toml, templates/gemm_rs.toml give the measurements):
the GEMM is cuBLAS's, the collective NCCL's, and the overlap costs a little of
both (chunks of M / chunks rows run below cuBLAS's full-size speed; NCCL's
kernels take SMs from the GEMM while they run).

Ordering, with no flags of ours: ProcessGroupNCCL makes its stream wait for
the caller's before each collective (so a chunk's collective starts after its
GEMM) and ``work.wait()`` makes the caller's stream wait for the collective
without blocking the host. A peer that never calls blocks in NCCL, as on the
plain path: config.timeout_s does not bound it. On gloo (CPU) the same calls
run one after another.

Numerics: those of the plain path (partials rounded to the output dtype,
summed by the collective), chunk by chunk.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist

from ..runtime.collectives import all_gather_single, reduce_scatter_single


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``rows`` cut into at most ``chunks`` runs of near-equal length, none empty."""
    cuts = [rows * i // chunks for i in range(chunks + 1)]
    return [(start, stop) for start, stop in pairwise(cuts) if stop > start]


def all_reduce_pipelined(
    x: torch.Tensor,  # [M, K_local]
    w: torch.Tensor,  # [K_local, N]
    group: dist.ProcessGroup,
    out: torch.Tensor,  # [M, N]
    chunks: int,
) -> torch.Tensor:
    """out = all_reduce(x @ w), row chunk by row chunk."""
    pending = []
    for start, stop in chunk_bounds(x.shape[0], chunks):
        torch.matmul(x[start:stop], w, out=out[start:stop])
        pending.append(dist.all_reduce(out[start:stop], group=group, async_op=True))
    for work in pending:
        work.wait()
    return out


def reduce_scatter_pipelined(
    x: torch.Tensor,  # [M, K_local], M a multiple of the world size
    w: torch.Tensor,  # [K_local, N]
    group: dist.ProcessGroup,
    out: torch.Tensor,  # [M / world, N]: this rank's rows of the sum
    chunks: int,
    avg: bool,
) -> torch.Tensor:
    """out = reduce_scatter(x @ w) (divided by the world size if ``avg``).

    Chunk c holds rows c of every rank's segment: the GEMM computes them into
    one [world, rows, N] buffer (a matmul per owner: the rows are not adjacent
    in x), whose reduce-scatter gives each owner its chunk c."""
    world = dist.get_world_size(group)
    segment, n = x.shape[0] // world, w.shape[1]
    nccl = x.device.type == "cuda"  # gloo has no AVG
    op = dist.ReduceOp.AVG if avg and nccl else dist.ReduceOp.SUM
    pending = []
    for start, stop in chunk_bounds(segment, chunks):
        partial = torch.empty((world, stop - start, n), dtype=x.dtype, device=x.device)
        for owner in range(world):
            first = owner * segment
            torch.matmul(x[first + start : first + stop], w, out=partial[owner])
        flat = partial.view(world * (stop - start), n)
        pending.append(
            reduce_scatter_single(out[start:stop], flat, op=op, group=group, async_op=True)
        )
    for work in pending:
        work.wait()
    return out.div_(world) if avg and not nccl else out


def all_gather_pipelined(
    x: torch.Tensor,  # [M_local, K], this rank's rows
    w: torch.Tensor,  # [K, N]
    group: dist.ProcessGroup,
    out: torch.Tensor,  # [M_local * world, N]
    chunks: int,
    gathered: torch.Tensor | None = None,  # [M_local * world, K]: filled too when given
) -> torch.Tensor:
    """out = all_gather(x) @ w. Chunk c holds rows c of every rank's x."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    m_local, k = x.shape
    arriving = []
    for start, stop in chunk_bounds(m_local, chunks):
        rows = torch.empty((world, stop - start, k), dtype=x.dtype, device=x.device)
        work = all_gather_single(rows.view(-1, k), x[start:stop], group=group, async_op=True)
        arriving.append((start, stop, rows, work))
    torch.matmul(x, w, out=out[rank * m_local : (rank + 1) * m_local])
    for start, stop, rows, work in arriving:
        work.wait()
        for src in range(world):
            first = src * m_local
            if src != rank:
                torch.matmul(rows[src], w, out=out[first + start : first + stop])
            if gathered is not None:
                gathered[first + start : first + stop].copy_(rows[src])
    return out
