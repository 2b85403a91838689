"""GEMM + reduce-scatter with a bias + residual epilogue:
``residual + bias + reduce_scatter(x @ w)``.

A tensor-parallel block's last projection with sequence parallelism: each rank
holds x [M, K_local] and w [K_local, N] (its slice of K); rank r returns its
rows [r * M // world, (r + 1) * M // world) of the sum over ranks, plus the
bias and this rank's residual rows. Our gemm_rs followed by an add kernel would
round the sum, store it and read it back; here the reduction's epilogue adds
both in fp32 and rounds once.
"""

from __future__ import annotations

import torch

from overlap_kernels import FusedOp  # (before Triton: it turns the interpreter on where no GPU is)

# isort: split
import triton
import triton.language as tl

from overlap_kernels import language as ol


@triton.jit
def _gemm_rs_bias_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, N, K, ctx,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # x [M, K], w [K, N]: this rank's slice of K; bias [N]; residual, out [own rows, N]
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    t = ol.next_tile(ctx)
    while t < ol.num_tiles(ctx):
        row_start, row_stop, col_start = ol.tile_rows(ctx, t)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = ol.dot(x_desc.load([row_start, k]), w_desc.load([k, col_start]), acc)
        if ol.is_mine(ctx, t):  # own rows: every peer's partial, then the epilogue
            ol.wait_partials(ctx, t)
            acc = ol.add_partials(ctx, t, acc, out_ptr.dtype.element_ty)
            rows = row_start + tl.arange(0, BLOCK_M)
            cols = col_start + tl.arange(0, BLOCK_N)
            mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
            offs = (rows - ol.first_own_row(ctx))[:, None] * N + cols[None, :]
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, ol.round_to(acc, out_ptr.dtype.element_ty), mask=mask)
        else:  # a peer's rows: its partial goes to the owner
            ol.put_tile(ctx, t, ol.round_to(acc, out_ptr.dtype.element_ty))
            ol.signal_tile(ctx, t)
        t = ol.next_tile(ctx)
    ol.finish(ctx)


def _launch(run, x, w, bias, residual):
    m, k = x.shape
    block_k = 32 if x.dtype == torch.float32 else 64  # (K blocks of 128 bytes)
    run.launch(_gemm_rs_bias_kernel, x, w, bias, residual, run.out, m, w.shape[1], k, run.ctx,
               BLOCK_M=run.block_m, BLOCK_N=run.block_n, BLOCK_K=block_k,
               num_warps=8, num_stages=4)  # fmt: skip


# Tiles and stages: the fastest of seven at 4096x4096x3584 on one H200, one rank
# (bench/logs/probe_example_tiles_h200x1_20261129T1455.log).
GEMM_RS_BIAS = FusedOp("gemm_rs_bias", _launch, kind="reduce",
                       config={"block_m": 128, "block_n": 128}, own_rows=(2,))  # fmt: skip


def gemm_rs_bias(x, w, bias, residual, group=None, *, schedule=None, config=None):
    """``residual + bias + reduce_scatter(x @ w)``: x [M, K_local], w [K_local, N]
    row-major, bias [N], residual [this rank's rows, N]; returns [this rank's rows, N]."""
    if not (w.is_contiguous() and bias.is_contiguous() and residual.is_contiguous()):
        raise ValueError("gemm_rs_bias: w, bias and residual must be contiguous")
    return GEMM_RS_BIAS(x, w, bias, residual, n=w.shape[1], group=group, schedule=schedule,
                        config=config)  # fmt: skip
