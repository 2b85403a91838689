"""Weighted sums of gathered rows: the MoE combine's reductions, one pass each.

    out[i] = round(sum over w with rows[i, w] >= 0 of scale(rows[i, w]) * row(w, rows[i, w]))

``rows`` [I, W] holds row indices (-1: nothing); ``row(w, n)`` is the N
elements at byte address ``base(w) + n * row_bytes``, where ``base(w)`` is one
base for every column or ``column_bases[w]``: a local tensor or a peer's
symmetric memory alike. So the same kernel sums an owner's pairs of a token
(local rows, routing weights as scales, one column per top-k slot) and a
home's partials of a token (one column per owner rank, read over NVLink where
they lie). The tables come straight from the routing, with no sort. Sums run
in fp32, in ``w`` order, and the result is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import TL_DTYPES, interpreted_bf16, round_output

# Columns per program: 1024 bf16 = 2 KiB of each row, 16-byte vectors for 4 warps.
_BLOCK_N = 1024


# Addresses and buffer halves change call to call: not specialised on.
@triton.jit(do_not_specialize=["base", "row_bytes"])
def gather_sum_kernel(
    rows_ptr, width,  # int64 [I, width]
    base, column_bases_ptr, row_bytes, scales_ptr,  # int64 [width] (COLUMN_BASES), fp32 [rows] (HAS_SCALES)
    out_ptr, stride_out, N,  # out [I, N]
    SRC_DTYPE: tl.constexpr, COLUMN_BASES: tl.constexpr, HAS_SCALES: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    itemsize: tl.constexpr = SRC_DTYPE.primitive_bitwidth // 8
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w in range(width):
        row = tl.load(rows_ptr + i * width + w)
        if row >= 0:
            if COLUMN_BASES:
                at = tl.load(column_bases_ptr + w)
            else:
                at = base
            src = (at + row * row_bytes + cols.to(tl.int64) * itemsize).to(
                tl.pointer_type(SRC_DTYPE)
            )
            values = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALES:
                values = values * tl.load(scales_ptr + row)
            acc += values
    out = out_ptr + i * stride_out + cols
    tl.store(out, round_output(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


def gather_sum(
    rows: torch.Tensor,
    bases: int | torch.Tensor,
    row_bytes: int,
    out: torch.Tensor,
    src_dtype: torch.dtype,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i]`` = the (scaled) sum of the rows that ``rows[i]`` names (int64
    [I, W], -1: none) at ``bases`` (one byte address, or int64 [W] per column)."""
    n_rows, n = out.shape
    if n_rows == 0 or n == 0:
        return out
    column_bases = isinstance(bases, torch.Tensor)
    grid = (n_rows, triton.cdiv(n, _BLOCK_N))
    gather_sum_kernel[grid](
        rows, rows.shape[1], 0 if column_bases else bases, bases if column_bases else rows, row_bytes,
        scales if scales is not None else out, out, out.stride(0), n,
        SRC_DTYPE=TL_DTYPES[src_dtype], COLUMN_BASES=column_bases, HAS_SCALES=scales is not None,
        INTERPRETED_BF16=interpreted_bf16(out.dtype), BLOCK_N=_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out
