"""Hugging Face transformers tensor parallelism whose all-reduce runs inside
``gemm_ar``: a style registered in transformers' style registry under our own
name, for a model's ``tp_plan`` to name::

    from overlap_kernels.integrations.transformers import overlap_tp_plan

    config = AutoConfig.from_pretrained(path)
    config.base_model_tp_plan = overlap_tp_plan(config.base_model_tp_plan)  # registers the styles
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, distributed_config=DistributedConfig(tp_size=world)
    )

or, rule by rule (the override's names are the loaded class's, "model." included for
a ``*ForCausalLM``): ``register_styles()`` then
``DistributedConfig(tp_size=world, tp_plan={"model.layers.*.mlp.down_proj": "ok_rowwise"})``.

- ``"ok_rowwise"``: transformers' ``"rowwise"`` (weight ``Shard(-1)``, bias
  replicated, input this rank's slice of the last dim, output replicated on
  every rank), with the local matmul and the all-reduce as one ``gemm_ar``
  (``functional.linear_ar``: differentiable; the bias added once, after the
  reduction). Sharding, loading and checkpoints are the stock style's.

A call our op cannot serve runs the stock style's forward instead (decided
from shapes, dtypes and layouts, alike on every rank): a module that is not
an ``nn.Linear`` or whose ``in_features`` do not divide by the mesh size
(``gemm_ar`` wants the same shapes on every rank), a DTensor input in another
layout, keyword or extra arguments, an input whose last dim is not the local
weight's, a dtype other than the weight's (or not fp32/bf16/fp16), an empty
input, autocast, quantized modules, a parameter that is no longer a DTensor
in the stock layout.

Sequence parallelism: transformers 5.23 registers a ``"sequence_parallel"``
style (norms on a sequence-sharded DTensor), but no model plan uses it, no
registered colwise/rowwise style gathers a sequence-sharded input or
reduce-scatters onto the sequence, and ``DistributedConfig`` says its
``enable_sequence_parallel`` is "not wired up yet"; Llama's attention also
reshapes q/k/v by its input's (local) sequence length. There is no SP plan
for ``ag_gemm`` / ``gemm_rs`` styles to serve, so none is registered.

Imports transformers only inside :func:`register_styles`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from . import functional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ROWWISE = "ok_rowwise"
_STOCK = {"rowwise": ROWWISE}  # stock style -> ours, for overlap_tp_plan
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the GEMM core's


def _tp_group(mesh):
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def _is_layout(t, placement) -> bool:
    """Whether ``t`` is a DTensor on one mesh dim with ``placement`` (normalized)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or len(t.placements) != 1:
        return False
    (have,) = t.placements
    if isinstance(placement, Shard) and isinstance(have, Shard):
        return have.dim % t.ndim == placement.dim % t.ndim
    return have == placement


def _served_input(module, x):
    """This rank's [..., K_local] slice of ``x`` where gemm_ar can serve the call, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    weight, bias = module.weight, module.bias
    if not _is_layout(weight, Shard(1)) or not (bias is None or _is_layout(bias, Replicate())):
        return None
    if isinstance(x, DTensor):
        if not _is_layout(x, Shard(-1)):
            return None
        x = x.to_local()  # (differentiable: its gradient is this rank's slice)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.numel() == 0:
        return None
    w_local = weight.to_local()
    if x.shape[-1] != w_local.shape[1] or x.dtype != w_local.dtype or x.dtype not in _DTYPES:
        return None
    if x.device != w_local.device or torch.is_autocast_enabled(x.device.type):
        return None
    return x


def _rowwise_forward(module, mesh, use_local_output: bool, stock, *args, **kwargs):
    x = _served_input(module, args[0]) if len(args) == 1 and not kwargs else None
    if x is None:
        return stock(*args, **kwargs)
    bias = module.bias
    y = functional.linear_ar(x, module.weight.to_local(), None if bias is None else bias.to_local(),
                             _tp_group(mesh))  # fmt: skip
    if use_local_output:
        return y
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(y, mesh, [Replicate()], run_check=False)


@functools.cache
def _rowwise_style():
    """The style instance (its class subclasses transformers' RowwiseParallel)."""
    from torch.distributed.tensor import Replicate, Shard

    try:
        from transformers.distributed.tensor_parallel import RowwiseParallel
    except ImportError:  # the older module (a shim to the above in 5.23; untested)
        from transformers.integrations.tensor_parallel import RowwiseParallel
    if not hasattr(RowwiseParallel, "install_forward"):
        raise ImportError(
            "overlap_kernels.integrations.transformers needs transformers' TensorParallelLayer."
            "install_forward (transformers 5.23 has it); the installed RowwiseParallel lacks it"
        )

    class OverlapRowwiseParallel(RowwiseParallel):
        """transformers' row-wise style whose matmul + all-reduce runs as one gemm_ar."""

        def install_forward(self, module: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
            super().install_forward(module, mesh)  # the stock forward: our fallback
            servable = (
                isinstance(module, torch.nn.Linear)
                and self.output_layouts == Replicate()
                and self.input_layouts == Shard(-1)
                and module.in_features % mesh.size() == 0
                and not getattr(module, "_hf_quantized_needs_local_tp", False)
            )
            if servable:
                module.forward = functools.partial(
                    _rowwise_forward, module, mesh, self.use_local_output, module.forward
                )
            return module

    return OverlapRowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())


def _registry():
    try:
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    except ImportError:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    return ALL_PARALLEL_STYLES


def register_styles() -> tuple[str, ...]:
    """Register our styles in transformers' registry (global: every model and
    plan sees them); idempotent. Returns their names. A name already taken by
    another style raises ValueError."""
    registry, style = _registry(), _rowwise_style()
    have = registry._global_mapping.get(ROWWISE)
    if have is not None and have is not style:
        raise ValueError(
            f"register_styles: transformers' style registry already maps '{ROWWISE}' to {have!r}"
        )
    type(registry).register(ROWWISE, style)
    return (ROWWISE,)


def overlap_tp_plan(plan: dict[str, str]) -> dict[str, str]:
    """A copy of ``plan`` (a transformers tp_plan) with each stock style we
    serve swapped for ours ("rowwise" -> "ok_rowwise"); registers them."""
    register_styles()
    return {name: _STOCK.get(style, style) for name, style in plan.items()}
