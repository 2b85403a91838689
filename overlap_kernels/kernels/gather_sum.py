"""Weighted sums of gathered rows: the MoE combine's reductions, one pass each.

    out[i] = round(sum over j in [starts[i], starts[i + 1]) of scale[j] * row(j))

``row(j)`` is N elements at byte address ``addrs[j]``: a row of a local tensor
or of a peer's symmetric memory alike, so the same kernel sums an owner's
pairs of a token (local rows, routing weights) and a home's partials of a
token (peers' rows, read over NVLink where they lie). Sums run in fp32, in
``j`` order, and the result is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import TL_DTYPES, interpreted_bf16, round_output

# Columns per program: 1024 bf16 = 2 KiB of each row, 16-byte vectors for 4 warps.
_BLOCK_N = 1024


@triton.jit
def gather_sum_kernel(
    addrs_ptr, scales_ptr, starts_ptr,  # int64 [J], fp32 [J], int32 [I + 1]
    out_ptr, stride_out, N,  # out [I, N]
    SRC_DTYPE: tl.constexpr, HAS_SCALES: tl.constexpr, INTERPRETED_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    itemsize: tl.constexpr = SRC_DTYPE.primitive_bitwidth // 8
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(tl.load(starts_ptr + i), tl.load(starts_ptr + i + 1)):
        row = (tl.load(addrs_ptr + j) + cols.to(tl.int64) * itemsize).to(tl.pointer_type(SRC_DTYPE))
        values = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALES:
            values = values * tl.load(scales_ptr + j)
        acc += values
    out = out_ptr + i.to(tl.int64) * stride_out + cols
    tl.store(out, round_output(acc, out_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


def gather_sum(
    addrs: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, src_dtype: torch.dtype, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[i]`` = the (scaled) sum of the rows at ``addrs[starts[i]:starts[i + 1]]``."""
    rows, n = out.shape
    if rows == 0 or n == 0:
        return out
    grid = (rows, triton.cdiv(n, _BLOCK_N))
    gather_sum_kernel[grid](
        addrs, scales if scales is not None else addrs, starts, out, out.stride(0), n,
        SRC_DTYPE=TL_DTYPES[src_dtype], HAS_SCALES=scales is not None,
        INTERPRETED_BF16=interpreted_bf16(out.dtype), BLOCK_N=_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out


def segment_starts(keys: torch.Tensor, segments: int) -> torch.Tensor:
    """int32 [segments + 1]: where each key's run starts in ``keys`` sorted."""
    counts = torch.zeros(segments, dtype=torch.int64, device=keys.device).scatter_add_(0, keys, torch.ones_like(keys))
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
