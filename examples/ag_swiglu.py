"""All-gather + gate/up GEMM + SwiGLU: ``silu(x @ w_gate) * (x @ w_up)`` for the gathered x.

A tensor-parallel MLP's first half with sequence parallelism: each rank holds
x [M_local, K] and the columns [K, N] of both weights it owns. Our ag_gemm would
return [M, 2N] and leave the activation to another kernel; here the epilogue
applies it, so the [M, 2N] product never reaches memory.
"""

from __future__ import annotations

import torch

from overlap_kernels import FusedOp  # (before Triton: it turns the interpreter on where no GPU is)

# isort: split
import triton
import triton.language as tl

from overlap_kernels import language as ol


@triton.jit
def _ag_swiglu_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K, ctx,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # x [M, K]: the gathered rows (they arrive chunk by chunk); w_gate, w_up [K, N]; out [M, N]
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    wg_desc = tl.make_tensor_descriptor(wg_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    wu_desc = tl.make_tensor_descriptor(wu_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    t = ol.next_tile(ctx)
    while t < ol.num_tiles(ctx):
        row_start, row_stop, col_start = ol.tile_rows(ctx, t)
        ol.wait_rows(ctx, t)  # once per tile, before the K loop
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([row_start, k])  # (rows past the tile's chunk are never stored)
            gate = ol.dot(a, wg_desc.load([k, col_start]), gate)
            up = ol.dot(a, wu_desc.load([k, col_start]), up)
        h = gate * tl.sigmoid(gate) * up
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :],
                 ol.round_to(h, out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        t = ol.next_tile(ctx)
    ol.finish(ctx)


def _launch(run, x, w_gate, w_up):
    m, k = run.gathered.shape
    block_k = 32 if x.dtype == torch.float32 else 64  # (K blocks of 128 bytes)
    run.launch(_ag_swiglu_kernel, run.gathered, w_gate, w_up, run.out, m, w_gate.shape[1], k,
               run.ctx, BLOCK_M=run.block_m, BLOCK_N=run.block_n, BLOCK_K=block_k,
               num_warps=8, num_stages=4)  # fmt: skip


# Tiles and stages: the fastest of seven at 4096x4096x3584 on one H200, one rank
# (bench/logs/probe_example_tiles_h200x1_20261129T1455.log).
AG_SWIGLU = FusedOp("ag_swiglu", _launch, kind="gather", config={"block_m": 128, "block_n": 128})


def ag_swiglu(x, w_gate, w_up, group=None, *, schedule=None, config=None):
    """``silu(all_gather(x) @ w_gate) * (all_gather(x) @ w_up)``: x [M_local, K] this
    rank's rows, w_gate and w_up [K, N] row-major; returns [M_local * world, N]."""
    if w_gate.shape != w_up.shape or not (w_gate.is_contiguous() and w_up.is_contiguous()):
        raise ValueError("ag_swiglu: w_gate and w_up must be contiguous [K, N] of one shape")
    return AG_SWIGLU(x, w_gate, w_up, n=w_gate.shape[1], group=group, schedule=schedule,
                     config=config)  # fmt: skip
