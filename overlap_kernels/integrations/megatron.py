"""Megatron-core: tensor-parallel linears whose communication runs inside our fused ops.

Use the GPT layer spec with our linears, everything else as before::

    from overlap_kernels.integrations.megatron import get_gpt_layer_overlap_spec

    layer_spec = get_gpt_layer_overlap_spec()  # the arguments of get_gpt_layer_local_spec
    # or: swap_linears(any_spec); or build specs with OverlapSpecProvider()

What runs where (tensor-parallel size > 1; Megatron's input is [s, b, h], s
sharded with sequence parallelism, viewed as [s * b, h] rows, which keeps
Megatron's row order: a gather of dim 0 is a gather of the rows):

===========================  ========================  =================================
layer (GPT spec name)        sequence parallel on      sequence parallel off
===========================  ========================  =================================
column (linear_qkv, fc1)     ag_gemm; see below        Megatron's own (local GEMM)
row (linear_proj, fc2)       gemm_rs; dgrad ag_gemm    gemm_ar; backward local
===========================  ========================  =================================

The column layer keeps its input shard alone, as Megatron's does, so its
backward gathers the input again for wgrad, beside the dgrad GEMM, and
reduce-scatters dgrad beside the wgrad GEMM (Megatron's pipeline; without
wgrad, dgrad is gemm_rs).

Only the forward changes: constructors, parameter names, ``(output, bias)``
returns, ``skip_bias_add`` and ``sharded_state_dict`` are Megatron's, so
checkpoints load either way. Gradients are the library's formulas
(integrations/autograd.py). Bias: the column adds it to its output shard, the
row once after the reduction (with sequence parallelism its gradient is this
rank's tokens' sum, as in Megatron, whose finalize_model_grads all-reduces
parameters marked ``sequence_parallel``).

``gradient_accumulation_fusion`` (``weight.main_grad``): the weight gradient
is added to ``main_grad`` in backward, ``grad_added_to_main_grad`` is set and
a dummy gradient returned, as Megatron's own layers do, so its DDP hooks work
unchanged. The add is a separate one after the wgrad GEMM, in the weight's
dtype (Megatron's fused kernel accumulates the GEMM into fp32 directly).

Megatron's own path runs (``super()``), with one log line per reason and
process, for what ours does not serve: expert layers (explicit expert
communication), deferred embedding wgrad (``grad_output_buffer``), a row
input not yet split (``input_is_parallel=False``), activation CPU offloading,
GTP-sharded weights, ``output_dtype``, Megatron-FSDP's ``main_grad``, dtypes
other than fp32/bf16/fp16, a sequence not divisible by the TP size, and
arguments this module does not know (a newer Megatron's). Frozen weights are
served (no weight gradient is computed). Written against megatron-core 0.16.1
(run) and the same APIs in 0.17.1, 0.19.0 and git main (read, not run).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, TypeVar

import torch
from torch.autograd.function import FunctionCtx

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..ops.checks import SUPPORTED_DTYPES
from . import functional

try:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as error:  # (an optional dependency: only this module needs it)
    raise ImportError(
        "overlap_kernels.integrations.megatron needs megatron-core: "
        "pip install 'overlap_kernels[megatron]'"
    ) from error

logger = logging.getLogger(__name__)
_Spec = TypeVar("_Spec")  # a spec: ModuleSpec, submodules dataclass, or a list or tuple of them

# The keyword arguments ColumnParallelLinear.forward passes to _forward_impl
# (0.16.1 to git main); any other means a newer Megatron asks for something
# we do not know, and its own path runs.
_FORWARD_IMPL_ARGS = frozenset({
    "input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad",
    "sequence_parallel", "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce",
    "tp_group", "gtp_remat_size", "output_dtype",
})  # fmt: skip


@functools.cache
def _note_fallback(layer: str, reason: str) -> None:
    logger.info("%s: %s, so Megatron's own path runs", layer, reason)


# ---- gradient_accumulation_fusion ------------------------------------------------


class _IntoMainGrad(torch.autograd.Function):
    """Identity on the weight; backward adds the weight's gradient to the
    ``main_grad`` it had in forward and answers as Megatron's own layers do:
    a dummy gradient and ``grad_added_to_main_grad = True`` where the
    attribute exists (Megatron's DDP then skips its own add), else None."""

    @staticmethod
    def forward(ctx: FunctionCtx, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.main_grad = weight.main_grad  # (a module reused across layers may swap it)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor | None:
        (weight,) = ctx.saved_tensors
        weight.main_grad = ctx.main_grad
        ctx.main_grad.add_(grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(ctx.main_grad.shape, dtype=grad.dtype, device=grad.device)


def _weight_for_ops(weight: torch.Tensor, gradient_accumulation_fusion: bool) -> torch.Tensor:
    if (
        gradient_accumulation_fusion
        and weight.requires_grad
        and torch.is_grad_enabled()
        and getattr(weight, "main_grad", None) is not None
    ):
        return _IntoMainGrad.apply(weight)
    return weight


def _unserved_operands(x: torch.Tensor, weight: torch.Tensor, fusion: bool) -> str | None:
    """Why the fused ops cannot take these operands, or None."""
    if x.dim() < 2:
        return f"a {x.dim()}-D input"
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return f"input {x.dtype} with weight {weight.dtype}"
    if fusion and hasattr(weight, "__fsdp_param__"):
        return "Megatron-FSDP's main_grad"
    return None


def _offloading(config) -> bool:
    context = getattr(config, "_cpu_offloading_context", None)
    return context is not None and getattr(context, "inside_context", False) is True


# ---- the layers ------------------------------------------------------------------


class OverlapColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear``; with sequence parallelism its input
    all-gather runs inside ``ag_gemm``, and its backward gathers the input again
    beside the dgrad GEMM (``gemm_rs`` alone where no wgrad is needed). Without,
    Megatron's own path."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or not kwargs.get("sequence_parallel"):
            return super()._forward_impl(input, weight, *args, **kwargs)
        fusion = bool(kwargs.get("gradient_accumulation_fusion"))
        reason = _unserved_operands(input, weight, fusion)
        unknown = set(kwargs) - _FORWARD_IMPL_ARGS
        if unknown:
            reason = f"argument(s) {sorted(unknown)} unknown to this integration"
        elif kwargs.get("grad_output_buffer") is not None:
            reason = "deferred embedding wgrad (grad_output_buffer)"
        elif (kwargs.get("gtp_remat_size") or 1) > 1:
            reason = "a GTP-sharded weight"
        elif kwargs.get("output_dtype") not in (None, input.dtype):
            reason = f"output_dtype {kwargs['output_dtype']}"
        elif _offloading(self.config):
            reason = "activation CPU offloading"
        if reason is not None:
            _note_fallback(type(self).__name__, reason)
            return super()._forward_impl(input, weight, *args, **kwargs)

        group = kwargs.get("tp_group")
        group = self.tp_group if group is None else group
        x2d = input.reshape(-1, input.shape[-1]).contiguous()  # [s_local * b, h]
        # Megatron's activation memory: the input shard kept, not the gathered input.
        y = functional.linear_ag(x2d, _weight_for_ops(weight, fusion), kwargs.get("bias"), group,
                                 keep_gathered=False)  # fmt: skip
        return y.view(input.shape[0] * group.size(), *input.shape[1:-1], -1)  # [s, b, n_local]


class OverlapRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` whose output reduction runs inside
    ``gemm_rs`` (sequence parallelism: reduce-scatter over s) or ``gemm_ar``
    (all-reduce)."""

    def _unserved(self, input_: torch.Tensor) -> str | None:
        """Why our ops do not serve this call ('' where nothing is worth a log line), or None."""
        world = self.tp_group.size()
        if world == 1:
            return ""  # (nothing to communicate)
        if not self.input_is_parallel:
            return "an input not split over the ranks (input_is_parallel=False)"
        if self.explicit_expert_comm:
            return "an expert layer (explicit expert communication)"
        if getattr(self, "gtp_remat_size", 1) > 1:
            return "a GTP-sharded weight"
        if _offloading(self.config):
            return "activation CPU offloading"
        if self.sequence_parallel and input_.dim() >= 2 and input_.shape[0] % world:
            return f"sequence length {input_.shape[0]} not divisible by the TP size {world}"
        return _unserved_operands(input_, self.weight, self.gradient_accumulation_fusion)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        reason = self._unserved(input_)
        if reason is not None:
            if reason:
                _note_fallback(type(self).__name__, reason)
            return super().forward(input_)

        x2d = input_.reshape(-1, input_.shape[-1]).contiguous()  # [s * b, h_local]
        weight = _weight_for_ops(self.weight, self.gradient_accumulation_fusion)
        bias = None if self.skip_bias_add else self.bias  # (added once, after the reduction)
        if self.sequence_parallel:
            y = functional.linear_rs(x2d, weight, bias, self.tp_group)
            output = y.view(input_.shape[0] // self.tp_group.size(), *input_.shape[1:-1], -1)
        else:
            y = functional.linear_ar(x2d, weight, bias, self.tp_group)
            output = y.view(*input_.shape[:-1], -1)
        return output, (self.bias if self.skip_bias_add else None)


# ---- specs -----------------------------------------------------------------------


class OverlapSpecProvider(LocalSpecProvider):
    """Megatron's ``LocalSpecProvider`` with our column- and row-parallel
    linears (for spec builders that take a ``backend=``, e.g.
    ``get_mlp_module_spec_for_backend``). Experts keep Megatron's linears."""

    def column_parallel_linear(self) -> type:
        return OverlapColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return OverlapRowParallelLinear


# The spec fields swap_linears replaces, and with what (only where they hold
# Megatron's plain linears: TE's and others' are left alone).
_SWAPS = {
    "linear_qkv": (ColumnParallelLinear, OverlapColumnParallelLinear),
    "linear_fc1": (ColumnParallelLinear, OverlapColumnParallelLinear),
    "linear_proj": (RowParallelLinear, OverlapRowParallelLinear),
    "linear_fc2": (RowParallelLinear, OverlapRowParallelLinear),
}
_NOT_SWAPPED = frozenset({"experts"})  # (expert linears communicate explicitly: Megatron's own)


def _swapped(value, field: str | None = None):
    if field in _SWAPS:
        stock, ours = _SWAPS[field]
        if value is stock:
            return ours
        if isinstance(value, ModuleSpec) and value.module is stock:
            return dataclasses.replace(value, module=ours)
    if field in _NOT_SWAPPED:
        return value
    if isinstance(value, functools.partial):  # (newer Megatron: partial(MLP.as_mlp_submodule, ...))
        keywords = {name: _swapped(v, name) for name, v in value.keywords.items()}
        return functools.partial(value.func, *(_swapped(a) for a in value.args), **keywords)
    if isinstance(value, list | tuple):
        return type(value)(_swapped(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _swapped(getattr(value, f.name), f.name) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def swap_linears(spec: _Spec) -> _Spec:
    """A copy of ``spec`` (a ModuleSpec, submodules dataclass or list of them)
    whose ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and ``linear_fc2``
    are our linears where they were Megatron's plain ColumnParallelLinear /
    RowParallelLinear. Nothing else changes; ``spec`` itself is not modified."""
    return _swapped(spec)


def get_gpt_layer_overlap_spec(*args: Any, **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec(*args, **kwargs)`` with our four TP linears."""
    return swap_linears(get_gpt_layer_local_spec(*args, **kwargs))
