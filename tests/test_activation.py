"""The MoE activation kernel (kernels/activation.py) against torch's ops, in
Triton's interpreter."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from overlap_kernels.kernels.activation import silu_mul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_matches_torch(dtype):
    torch.manual_seed(time.time_ns() % 2**31)
    h = (torch.randn(37, 2 * 1100) * 4).to(
        dtype
    )  # 1100 columns: two programs per row, the last masked
    got = silu_mul(h)
    f = h.shape[1] // 2
    exact = F.silu(h[:, :f].double()) * h[:, f:].double()
    # fp32 arithmetic (exp, add, divide, multiply) is off by at most ~4 fp32
    # ulps; rounding to bf16 / fp16 adds half an ulp of theirs, which dwarfs it.
    ulps = 4 if dtype == torch.float32 else 1
    ulp = ulps * torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert got.shape == (37, f) and got.dtype == dtype
    assert ((got.double() - exact).abs() <= ulp).all()
    if dtype != torch.float32:
        # Against the same arithmetic in torch: equal but where fp32's last bits
        # (libraries differ there) move a value across a rounding boundary.
        expected = (F.silu(h[:, :f].float()) * h[:, f:].float()).to(dtype)
        assert (got != expected).double().mean() < 0.01


def test_silu_mul_of_no_rows():
    assert silu_mul(torch.empty(0, 8)).shape == (0, 4)
