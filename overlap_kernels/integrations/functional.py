"""Tensor-parallel linear layers as functions, for code without DTensor.

``weight`` is an nn.Linear weight [N, K] (this rank's shard), ``bias`` [N]
or None; ``group`` a process group (None: the default one).

- ``linear_ag(x, weight, bias, group)``: column-parallel with sequence
  parallelism: x [T_local, K] (this rank's tokens) -> [T_local * W, N].
- ``linear_rs(x, weight, bias, group)``: row-parallel with sequence
  parallelism: x [T, K_local] -> this rank's tokens [T / W, N] of the sum.
- ``linear_ar(x, weight, bias, group)``: row-parallel, replicated output:
  x [..., K_local] -> [..., N], the sum over ranks, on every rank.

Differentiable in x, weight and bias (integrations/autograd.py). In eager
mode with no gradient to record they call the op's Python function directly
(the dispatcher would only add host time); under torch.compile, or where
autograd records, they go through ``torch.ops.overlap_kernels``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..ops.ag_gemm import ag_gemm
from ..ops.gemm_ar import gemm_ar
from ..ops.gemm_rs import gemm_rs
from ..runtime.errors import OverlapInputError
from . import autograd  # noqa: F401  (registers the ops' gradients)
from .torch_ops import name_of

_ops = torch.ops.overlap_kernels


def _dispatched(*tensors) -> bool:
    """Whether the call goes through the custom op: traced, or recorded by autograd."""
    return torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    )


def _two_d(op: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise OverlapInputError(
            f"{op}: x must be 2-D [tokens, features], got shape {tuple(x.shape)}"
        )


def _plus_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def linear_ag(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:  # fmt: skip
    _two_d("linear_ag", x)
    if _dispatched(x, weight):
        y = _ops.ag_gemm(x, weight.t(), name_of(group))[0]
    else:
        y = ag_gemm(x, weight.t(), group)
    return _plus_bias(y, bias)


def linear_rs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:  # fmt: skip
    _two_d("linear_rs", x)
    if _dispatched(x, weight):
        y = _ops.gemm_rs(x, weight.t(), name_of(group))
    else:
        y = gemm_rs(x, weight.t(), group)
    return _plus_bias(y, bias)  # once, after the reduction


def linear_ar(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:  # fmt: skip
    lead, x2d = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if _dispatched(x, weight):
        y = _ops.gemm_ar(x2d.contiguous(), weight.t(), name_of(group))
    else:
        y = gemm_ar(x2d.contiguous(), weight.t(), group)
    return _plus_bias(y, bias).reshape(*lead, weight.shape[0])
