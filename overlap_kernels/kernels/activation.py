"""The MoE expert's activation in one pass: act = silu(gate) * up.

h [R, 2F] holds each row's gate columns, then its up columns (the gate/up
GEMM's output). The product is computed in fp32 (as ``silu(gate.float()) *
up.float()``) and rounded once: one read of h and one write of act, where the
same arithmetic as separate torch ops makes four passes over fp32 copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import interpreted_bf16, round_output

_BLOCK = 1024  # columns per program: 2 KiB of bf16, 16-byte vectors for 4 warps


@triton.jit
def silu_mul_kernel(
    h_ptr, stride_h, out_ptr, stride_out, F, BLOCK: tl.constexpr, INTERPRETED_BF16: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + row * stride_out + cols,
        round_output(act, out_ptr.dtype.element_ty, INTERPRETED_BF16),
        mask=mask,
    )


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[R, F] = silu(h[:, :F]) * h[:, F:] for h [R, 2F] with unit column stride."""
    rows, width = h.shape
    f = width // 2
    out = torch.empty((rows, f), dtype=h.dtype, device=h.device)
    if rows and f:
        silu_mul_kernel[(rows, triton.cdiv(f, _BLOCK))](
            h,
            h.stride(0),
            out,
            out.stride(0),
            f,
            BLOCK=_BLOCK,
            INTERPRETED_BF16=interpreted_bf16(h.dtype),
            num_warps=4,
        )
    return out
