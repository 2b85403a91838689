"""matmul: the local persistent GEMM core of the fused ops, alone (no waits).

The floor of every fused op's time; benchmarked against cuBLAS on its own.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.gemm import launch_chunked_gemm, mblock_table
from ..runtime.platform import num_sms
from ..tuning import build_config, shape_key
from .ag_gemm import AgGemmConfig
from .checks import (
    check_gemm_operands,
    check_out,
    check_tiles_fit,
    require,
    resolve_epilogue,
    tma_aligned,
    tma_layout_blocker,
)

OP = "matmul"


@functools.lru_cache(maxsize=64)
def _row_order(m: int, block_m: int, device: torch.device) -> torch.Tensor:
    return mblock_table([(0, m, -1, 0)], block_m, device)


def matmul(
    a: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [K, N]: row-major or weight.t()
    config: AgGemmConfig | dict | None = None,
    *,
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``a @ b`` with the chunk-aware persistent GEMM and the ag_gemm template's tiles."""
    check_gemm_operands(OP, a, b, "a", "b")
    shape = (a.shape[0], b.shape[1])
    check_out(OP, out, shape, a, a, b)
    blocker = tma_layout_blocker(a, b)
    require(blocker is None, OP, f"{blocker}; use torch.matmul for such shapes")
    key = shape_key(1, a.shape[0], a.shape[1], b.shape[1], a.dtype)
    cfg = build_config(AgGemmConfig, "ag_gemm", key, config)
    check_tiles_fit(OP, cfg, a.dtype, a.device, store_buffer=cfg.epilogue == "tma")
    out = out if out is not None else torch.empty(shape, dtype=a.dtype, device=a.device)
    cfg = resolve_epilogue(OP, cfg, out, shape[1])
    if min(shape) == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    a, b = tma_aligned(a), tma_aligned(b)
    launch_chunked_gemm(a, b, out, _row_order(a.shape[0], cfg.block_m, a.device), cfg, num_sms(a.device))
    return out
