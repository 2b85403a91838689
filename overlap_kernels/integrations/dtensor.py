"""Tensor-parallel styles for ``parallelize_module`` whose collectives run
inside our fused ops, eagerly and under ``torch.compile(fullgraph=True)``
(compiled models may instead keep torch's own styles and use the Inductor
pass, integrations/inductor.py)::

    parallelize_module(block, mesh, {
        "up": OverlapColwiseParallel(input_layouts=Shard(0)),     # ag_gemm
        "down": OverlapRowwiseParallel(output_layouts=Shard(0)),  # gemm_rs
    })

- ``OverlapColwiseParallel(input_layouts=Shard(0))``: the sequence-parallel
  input's all-gather runs inside ``ag_gemm``; output sharded on its last dim.
- ``OverlapRowwiseParallel``: output ``Shard(0)`` runs ``gemm_rs``,
  ``Replicate()`` (the default) runs ``gemm_ar``.

Inputs are 2-D [tokens, features], tokens sharded first (sequence-first, as
the ops gather and scatter rows). Weights are sharded as torch's styles shard
them (nn.Linear only); forward and backward go through the differentiable
functional layers (integrations/functional.py). Other layouts and modules
behave as torch's styles do.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import FunctionCtx
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..runtime.errors import OverlapInputError
from . import functional
from .torch_ops import name_of


def _local_input(style: str, x, mesh, layout):
    """This rank's part of ``x`` in ``layout`` (a local tensor is taken to be that part)."""
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, (layout,)).to_local()
    if x.dim() != 2:
        raise OverlapInputError(
            f"{style}: the input must be 2-D [tokens, features], got shape {tuple(x.shape)}"
        )
    return x


def _output(y, mesh, produced, wanted, use_local_output: bool):
    out = DTensor.from_local(y, mesh, produced, run_check=False)
    if out.placements != wanted:
        out = out.redistribute(mesh, wanted)
    return out.to_local() if use_local_output else out


def _local(param):
    return None if param is None else param.to_local()


def _colwise_forward(module, mesh, output_layouts, use_local_output, keep_gathered, x):
    x = _local_input("OverlapColwiseParallel", x, mesh, Shard(0))
    y = functional.linear_ag(x, module.weight.to_local(), _local(module.bias), mesh.get_group(),
                             keep_gathered=keep_gathered)  # fmt: skip
    return _output(y, mesh, (Shard(-1),), output_layouts, use_local_output)


def _rowwise_forward(module, mesh, output_layouts, use_local_output, x):
    x = _local_input("OverlapRowwiseParallel", x, mesh, Shard(-1))
    if output_layouts == (Shard(0),):
        group = mesh.get_group()
        y = functional.linear_rs(x, module.weight.to_local(), None, group)
        if module.bias is not None:
            y = _RowsPlusBias.apply(y, module.bias.to_local(), name_of(group))
    else:
        y = functional.linear_ar(x, module.weight.to_local(), _local(module.bias), mesh.get_group())
    produced = output_layouts if output_layouts == (Shard(0),) else (Replicate(),)
    return _output(y, mesh, produced, output_layouts, use_local_output)


class _RowsPlusBias(torch.autograd.Function):
    """``rows + bias``, where ``rows`` are this rank's rows of a sequence-sharded
    output and ``bias`` is replicated: its gradient is the sum over every
    rank's rows, the same on each rank, as torch's RowwiseParallel gives a
    replicated bias (each rank's fp32 partial sums, gathered and added)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, rows: torch.Tensor, bias: torch.Tensor, group_name: str
    ) -> torch.Tensor:
        ctx.group_name, ctx.dtypes = group_name, (rows.dtype, bias.dtype)
        return rows + bias

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        partial = grad.sum(0, dtype=torch.float32)[None]  # [1, N]
        every = torch.ops.overlap_kernels.all_gather(partial.contiguous(), ctx.group_name)
        rows_dtype, bias_dtype = ctx.dtypes
        return grad.to(rows_dtype), every.sum(0).to(bias_dtype), None


class OverlapColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` whose ``Shard(0)`` input is gathered inside ``ag_gemm``.
    ``keep_gathered``: the gathered input is kept for the weight's gradient, as
    torch's style keeps it; False keeps this rank's tokens alone and gathers them
    again in backward (functional.linear_ag)."""

    def __init__(self, *args, keep_gathered: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_gathered = keep_gathered

    def _apply(self, module: torch.nn.Module, device_mesh):
        if not isinstance(module, torch.nn.Linear) or self.input_layouts != (Shard(0),):
            return super()._apply(module, device_mesh)
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = functools.partial(_colwise_forward, module, device_mesh, self.output_layouts,
                                           self.use_local_output, self.keep_gathered)  # fmt: skip
        return module


class OverlapRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` whose reduction runs inside ``gemm_rs`` (output
    ``Shard(0)``) or ``gemm_ar`` (output ``Replicate()``)."""

    def _apply(self, module: torch.nn.Module, device_mesh):
        if not isinstance(module, torch.nn.Linear) or self.output_layouts not in (
            (Shard(0),),
            (Replicate(),),
        ):
            return super()._apply(module, device_mesh)
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = functools.partial(_rowwise_forward, module, device_mesh, self.output_layouts,
                                           self.use_local_output)  # fmt: skip
        return module
