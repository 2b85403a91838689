"""overlap_kernels: fused multi-GPU layers that hide communication inside computation.

Without a CUDA device the library runs its Triton kernels in Triton's
interpreter on CPU tensors (one process per rank, gloo, shared-memory files),
which it turns on by itself: ``runtime.platform`` is imported first.
"""

# isort: off
# First, before anything imports triton: Triton decorates its own library
# functions at import time, in interpreter mode only if TRITON_INTERPRET is set.
from .runtime import platform  # noqa: F401

# isort: on
from . import schedules
from .ops.ag_gemm import AgGemmConfig, ag_gemm
from .ops.all_reduce import AllReduceConfig, all_reduce, all_reduce_rmsnorm
from .ops.autotune import autotune
from .ops.custom import FusedConfig, FusedOp
from .ops.gemm_ar import GemmArConfig, gemm_ar
from .ops.gemm_ar_rmsnorm import gemm_ar_rmsnorm
from .ops.gemm_rs import GemmRsConfig, gemm_rs
from .ops.matmul import matmul
from .ops.moe import (
    MoeCapacityError,
    MoeConfig,
    MoeHandle,
    moe_combine,
    moe_dispatch,
    moe_dispatch_gemm,
    moe_gemm_combine,
    moe_mlp,
)
from .ops.moe_graph import MoeGraphHandle, moe_combine_graph, moe_dispatch_graph
from .runtime import (
    OverlapError,
    OverlapInputError,
    OverlapMismatchError,
    OverlapTimeoutError,
    raise_if_failed,
    reset_workspaces,
    use_backend,
)
from .tuned import use_table

__version__ = "0.1.0"

__all__ = [
    "AgGemmConfig",
    "AllReduceConfig",
    "FusedConfig",
    "FusedOp",
    "GemmArConfig",
    "GemmRsConfig",
    "MoeCapacityError",
    "MoeConfig",
    "MoeGraphHandle",
    "MoeHandle",
    "OverlapError",
    "OverlapInputError",
    "OverlapMismatchError",
    "OverlapTimeoutError",
    "ag_gemm",
    "all_reduce",
    "all_reduce_rmsnorm",
    "autotune",
    "gemm_ar",
    "gemm_ar_rmsnorm",
    "gemm_rs",
    "matmul",
    "moe_combine",
    "moe_combine_graph",
    "moe_dispatch",
    "moe_dispatch_graph",
    "moe_dispatch_gemm",
    "moe_gemm_combine",
    "moe_mlp",
    "raise_if_failed",
    "reset_workspaces",
    "schedules",
    "use_backend",
    "use_table",
]
