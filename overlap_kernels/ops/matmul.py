"""matmul: the local persistent GEMM core of the fused ops, alone (no waits).

The floor of every fused op's time; benchmarked against cuBLAS on its own.
"""

from __future__ import annotations

import torch

from ..kernels.gemm import launch_chunked_gemm, mblock_table
from ..runtime.platform import num_sms
from ..tuning import build_config, shape_key
from .ag_gemm import AgGemmConfig
from .checks import (
    check_gemm_operands,
    check_out,
    check_tiles_fit,
    epilogue_for_new_out,
    new_out,
    refuse_grad,
    require,
    resolve_epilogue,
    tma_aligned,
    tma_layout_blocker,
)
from .plans import LOCAL, plan_for, signature

OP = "matmul"


def matmul(
    a: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [K, N]: row-major or weight.t()
    config: AgGemmConfig | dict | None = None,
    *,
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``a @ b`` with the chunk-aware persistent GEMM and the ag_gemm template's tiles
    (no gradient recorded: torch.matmul's where one is needed)."""
    refuse_grad(OP, a, b)
    plan = plan_for(OP, signature(OP, a, b, LOCAL, config), lambda: MatmulPlan(a, b, config))
    return plan(a, b, out)


class MatmulPlan:
    """The checks, config and M-block order of one signature (ops/plans.py)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, config):
        check_gemm_operands(OP, a, b, "a", "b")
        blocker = tma_layout_blocker(a, b)
        require(blocker is None, OP, f"{blocker}; use torch.matmul for such shapes")
        key = shape_key(1, a.shape[0], a.shape[1], b.shape[1], a.dtype)
        cfg = build_config(AgGemmConfig, "ag_gemm", key, config, device=a.device)
        check_tiles_fit(OP, cfg, a.dtype, a.device, store_buffer=cfg.epilogue == "tma")
        self.cfg = epilogue_for_new_out(OP, cfg, b.shape[1], a.dtype)
        self.out_shape = (a.shape[0], b.shape[1])
        self.row_order = mblock_table([(0, a.shape[0], -1, 0)], cfg.block_m, a.device)
        self.programs = num_sms(a.device)
        # (epilogue, out's row stride) -> the launch made again (kernels/relaunch.py): at
        # decode sizes host time is a call's time, and Triton's own launch path redoes
        # per-call work a relaunch skips
        self.relaunches: dict = {}

    def __call__(self, a, b, out):
        cfg = self.cfg
        if out is None:
            out = new_out(self.out_shape, a)
        else:
            check_out(OP, out, self.out_shape, a, a, b)
            cfg = resolve_epilogue(OP, cfg, out, self.out_shape[1])
        if min(self.out_shape) == 0:
            return out
        if a.shape[1] == 0:
            return out.zero_()
        a, b = tma_aligned(a), tma_aligned(b)
        key = (cfg.epilogue, out.stride(0))
        again = self.relaunches.get(key)
        if again is None or not again(a, b, out):
            self.relaunches[key] = launch_chunked_gemm(
                a, b, out, self.row_order, cfg, self.programs
            )
        return out
