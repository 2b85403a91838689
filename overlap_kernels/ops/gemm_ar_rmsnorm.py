"""gemm_ar_rmsnorm: a tensor-parallel decoder layer's reduction point as one op:
matmul, all-reduce, residual add, RMSNorm.

Problem
    Each rank holds x [M, K_local] and w [K_local, N] (row-major, or
    ``weight.t()`` of an nn.Linear weight: o_proj, down_proj); every rank returns
    ``(normed, residual_out)`` with ``residual_out = residual + sum_r x_r @ w_r``
    and ``normed = rmsnorm(residual_out, eps) * norm_weight`` (vLLM's
    ``fused_add_rms_norm`` after its all-reduce).

Algorithm
    torch.matmul (cuBLAS) computes this rank's partial, and the one-shot
    all-reduce with the residual add and RMSNorm fused after it
    (ops/all_reduce.py) reduces it: two launches, both of which replay in CUDA
    graphs. The product is cuBLAS's because at decode sizes our reduce GEMM core
    is 1.1-2.2x behind it (docs/performance.md, "The GEMM cores against the
    vendor"), more than overlapping the reduction could win back.
    Config: :class:`~overlap_kernels.ops.all_reduce.AllReduceConfig` (the path
    of the reduction: ``one_shot`` or ``sequential``, NCCL then the local norm).

Numerics
    As all_reduce_rmsnorm's, the partials being cuBLAS's products rounded to
    x's dtype: every rank returns the same bits.

Example (``torchrun --nproc-per-node 2 example.py``)::

    import torch, torch.distributed as dist
    from overlap_kernels import gemm_ar_rmsnorm
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)  # attention output, K slice
    o_proj = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)  # [N, K_local]
    residual = torch.randn(32, 8192, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    normed, residual = gemm_ar_rmsnorm(x, o_proj.t(), residual, weight, 1e-5)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .all_reduce import (
    AllReduceConfig,
    AllReducePlan,
    _norm_flags,
)
from .checks import check_gemm_operands, new_out, refuse_grad, require
from .plans import described, plan_for, shared_config, signature

OP = "gemm_ar_rmsnorm"


def gemm_ar_rmsnorm(
    x: torch.Tensor,  # [M, K_local]
    w: torch.Tensor,  # [K_local, N]
    residual: torch.Tensor | None,  # [M, N]
    norm_weight: torch.Tensor,  # [N]
    eps: float = 1e-6,
    group: dist.ProcessGroup | None = None,
    *,
    config: AllReduceConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [M, N]: normed
    residual_out: torch.Tensor | None = None,  # [M, N]; may be ``residual`` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of ``residual + all_reduce(x @ w)`` (module docstring)."""
    refuse_grad(OP, x, w, residual, norm_weight)
    weight_key = tuple(getattr(norm_weight, k, None) for k in ("shape", "dtype", "device"))
    weight_key += (norm_weight.stride() if isinstance(norm_weight, torch.Tensor) else None,)
    flags = (*_norm_flags(residual, norm_weight, eps), weight_key)
    key = signature(OP, x, w, group, config, *flags)
    plan = plan_for(OP, key, lambda: GemmArRmsnormPlan(x, w, residual, norm_weight, eps, group, config),
                    _gemm_shared)  # fmt: skip
    return plan(x, w, residual, norm_weight, out, residual_out)


def _gemm_shared(key: tuple, plan: GemmArRmsnormPlan) -> dict[str, str]:
    """all_reduce_rmsnorm's shared fields, x and w being the GEMM's operands."""
    _, _, x_shape, _, x_dtype, _, w_shape, _, w_dtype, _, _, *flags = key
    has_residual, _, eps, (weight_shape, weight_dtype, *_) = flags
    return {
        "x": described(x_shape, x_dtype),
        "w": described(w_shape, w_dtype),
        "weight": described(weight_shape, weight_dtype),
        "residual": str(has_residual),
        "eps": repr(eps),
        "config": shared_config(plan.cfg),
    }


class GemmArRmsnormPlan(AllReducePlan):
    """all_reduce_rmsnorm's plan for the [M, N] product, which it computes first."""

    def __init__(self, x, w, residual, norm_weight, eps, group, config):
        check_gemm_operands(OP, x, w, "x", "w")
        require(norm_weight is not None, OP, "norm_weight is required")
        product = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device="meta")
        for name, t in (("residual", residual), ("norm_weight", norm_weight)):
            if isinstance(t, torch.Tensor) and t.device != x.device:
                require(False, OP, f"{name} is on {t.device}, expected {x.device}")
        super().__init__(OP, product, residual, norm_weight, eps, group, config, device=x.device)

    def __call__(self, x, w, residual, norm_weight, out, residual_out):
        partial = torch.mm(x, w, out=new_out(self.out_shape, x))
        return super().__call__(partial, residual, norm_weight, out, residual_out)


__all__ = ["gemm_ar_rmsnorm"]
