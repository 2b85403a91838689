"""Sequence-parallel all-gather + RMSNorm + GEMM: ``rmsnorm(all_gather(x)) @ w``.

A sequence-parallel block's entry: each rank holds x [M_local, K] (its tokens,
before the norm) and w [K, N]; every rank needs the normalised gathered rows
times w. Gathering the normed rows would need a norm kernel before our
ag_gemm; here each tile normalises the rows of its arrived chunk as its K loop
reads them: the gain per column before the product (rounded to x's dtype, as
a normed tensor would be), 1 / rms per row after it, from the squares the same
loop sums. No normed copy of x is ever written.
"""

from __future__ import annotations

import torch

from overlap_kernels import FusedOp  # (before Triton: it turns the interpreter on where no GPU is)

# isort: split
import triton
import triton.language as tl

from overlap_kernels import language as ol


@triton.jit
def _ag_rmsnorm_gemm_kernel(x_ptr, gain_ptr, w_ptr, out_ptr, M, N, K, eps, ctx,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # x [M, K]: the gathered rows (they arrive chunk by chunk); gain [K]; w [K, N]; out [M, N]
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    t = ol.next_tile(ctx)
    while t < ol.num_tiles(ctx):
        row_start, row_stop, col_start = ol.tile_rows(ctx, t)
        ol.wait_rows(ctx, t)  # once per tile, before the K loop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([row_start, k]).to(tl.float32)  # (rows past the chunk: never stored)
            ks = k + tl.arange(0, BLOCK_K)
            gain = tl.load(gain_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            squares += tl.sum(a * a, axis=1)
            scaled = ol.round_to(a * gain[None, :], x_ptr.dtype.element_ty)
            acc = ol.dot(scaled, w_desc.load([k, col_start]), acc)
        acc = acc * (1.0 / tl.sqrt(squares / K + eps))[:, None]
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :],
                 ol.round_to(acc, out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        t = ol.next_tile(ctx)
    ol.finish(ctx)


def _launch(run, x, gain, w, eps):
    m, k = run.gathered.shape
    block_k = 32 if x.dtype == torch.float32 else 64  # (K blocks of 128 bytes)
    run.launch(_ag_rmsnorm_gemm_kernel, run.gathered, gain, w, run.out, m, w.shape[1], k, eps,
               run.ctx, BLOCK_M=run.block_m, BLOCK_N=run.block_n, BLOCK_K=block_k,
               num_warps=8, num_stages=3)  # fmt: skip


# Tiles and stages: the fastest of seven at 4096x4096x3584 on one H200, one rank
# (bench/logs/probe_example_tiles_h200x1_20261129T1455.log).
AG_RMSNORM_GEMM = FusedOp("ag_rmsnorm_gemm", _launch, kind="gather",
                          config={"block_m": 128, "block_n": 256})  # fmt: skip


def ag_rmsnorm_gemm(x, gain, w, eps=1e-6, group=None, *, schedule=None, config=None):
    """``rmsnorm(all_gather(x), eps) * gain @ w``: x [M_local, K] this rank's rows,
    gain [K], w [K, N] row-major; returns [M_local * world, N]."""
    if not (gain.is_contiguous() and w.is_contiguous()):
        raise ValueError("ag_rmsnorm_gemm: gain and w must be contiguous")
    return AG_RMSNORM_GEMM(x, gain, w, float(eps), n=w.shape[1], group=group, schedule=schedule,
                           config=config)  # fmt: skip
