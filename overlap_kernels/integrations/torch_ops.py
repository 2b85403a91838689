"""The fused ops as PyTorch custom ops: ``torch.ops.overlap_kernels.*``.

Registered with ``torch.library.Library.define`` + ``impl`` (the cheaper
dispatch path: a ``custom_op`` costs several times as much per call), with a
fake implementation each, so that ``torch.compile(fullgraph=True)`` traces
them. The group travels as its name (``group.group_name``), as PyTorch's own
symmetric-memory ops take it::

    ag_gemm(Tensor x, Tensor w, str group_name, *, bool return_gathered=False) -> (Tensor, Tensor?)
    gemm_rs(Tensor x, Tensor w, str group_name, str reduce_op="sum") -> Tensor
    gemm_ar(Tensor x, Tensor w, str group_name) -> Tensor
    ag_gemm_out / gemm_rs_out / gemm_ar_out(..., *, Tensor(a!) out) -> ()
    all_gather(Tensor x, str group_name) -> Tensor        # the backward formulas' collectives
    reduce_scatter(Tensor x, str group_name) -> Tensor    # (sum; gemm_rs's slices)
    moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down,
            str group_name, int num_experts, *, str? path=None, int? max_recv_tokens=None) -> Tensor

Shapes and meaning are those of :func:`overlap_kernels.ag_gemm`,
:func:`~overlap_kernels.gemm_rs`, :func:`~overlap_kernels.gemm_ar` and
:func:`~overlap_kernels.moe_mlp`; the ``_out`` variants write into ``out``
(declared mutated). ``moe_mlp``'s ``config`` is reduced to the two knobs a
model sets per layer, ``path`` ("auto", "fused", "unfused") and the capacity
``max_recv_tokens``; None takes the template's value, and every other knob
comes from the template and the tuned tables. Every op is tagged
``needs_fixed_stride_order``: the kernels read row-major x.

Gradients: :mod:`overlap_kernels.integrations.autograd` registers them.
``moe_mlp`` has none: its autograd kernel refuses, before anything is sent,
operands that require grad while grad mode is on (the differentiable MoE
layer is ``functional.moe_dispatch`` -> experts -> ``functional.moe_combine``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..ops.ag_gemm import ag_gemm
from ..ops.gemm_ar import gemm_ar
from ..ops.gemm_rs import gemm_rs, reduce_scatter_rows
from ..ops.moe import moe_mlp
from ..ops.reduce_details.plan import segment
from ..runtime.collectives import all_gather_single, collective

NAMESPACE = "overlap_kernels"
_TAGS = (torch.Tag.needs_fixed_stride_order,)

_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define(
    "ag_gemm(Tensor x, Tensor w, str group_name, *, bool return_gathered=False) -> (Tensor, Tensor?)",
    tags=_TAGS,
)
_lib.define(
    'gemm_rs(Tensor x, Tensor w, str group_name, str reduce_op="sum") -> Tensor', tags=_TAGS
)
_lib.define("gemm_ar(Tensor x, Tensor w, str group_name) -> Tensor", tags=_TAGS)
_lib.define("ag_gemm_out(Tensor x, Tensor w, str group_name, *, Tensor(a!) out) -> ()", tags=_TAGS)
_lib.define(
    'gemm_rs_out(Tensor x, Tensor w, str group_name, str reduce_op="sum", *, Tensor(a!) out) -> ()',
    tags=_TAGS,
)
_lib.define("gemm_ar_out(Tensor x, Tensor w, str group_name, *, Tensor(a!) out) -> ()", tags=_TAGS)
_lib.define("all_gather(Tensor x, str group_name) -> Tensor")
_lib.define("reduce_scatter(Tensor x, str group_name) -> Tensor")
_lib.define(
    "moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
    "str group_name, int num_experts, *, str? path=None, int? max_recv_tokens=None) -> Tensor",
    tags=_TAGS,
)


def group_of(group_name: str) -> dist.ProcessGroup:
    """The process group called ``group_name`` (``group.group_name``)."""
    return c10d._resolve_process_group(group_name)


def name_of(group: dist.ProcessGroup | None) -> str:
    """The name the ops take for ``group`` (None: the default group)."""
    return (group if group is not None else dist.group.WORLD).group_name


# ---- the implementations (CPU and CUDA alike) ---------------------------------


def _ag_gemm(x, w, group_name, *, return_gathered=False):
    if return_gathered:
        return ag_gemm(x, w, group_of(group_name), return_gathered=True)
    return ag_gemm(x, w, group_of(group_name)), None


def _gemm_rs(x, w, group_name, reduce_op="sum"):
    return gemm_rs(x, w, group_of(group_name), reduce_op=reduce_op)


def _gemm_ar(x, w, group_name):
    return gemm_ar(x, w, group_of(group_name))


def _ag_gemm_out(x, w, group_name, *, out):
    ag_gemm(x, w, group_of(group_name), out=out)


def _gemm_rs_out(x, w, group_name, reduce_op="sum", *, out):
    gemm_rs(x, w, group_of(group_name), out=out, reduce_op=reduce_op)


def _gemm_ar_out(x, w, group_name, *, out):
    gemm_ar(x, w, group_of(group_name), out=out)


# The backward formulas' collectives (integrations/autograd.py): c10d's, as the
# ops' plain paths issue them. (torch's functional collectives crashed the
# process when autograd's CUDA thread ran them on a gloo group, torch 2.11.)


def _all_gather(x, group_name):
    group = group_of(group_name)
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    collective("all_gather", "all-gather", all_gather_single, out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group_name):
    out = x.new_empty((rs_rows(x.shape[0], group_name), *x.shape[1:]))
    return reduce_scatter_rows(
        x.contiguous().clone(), group_of(group_name), out
    )  # (it may overwrite its input)


def moe_config(path: str | None, max_recv_tokens: int | None) -> dict | None:
    """moe_mlp's config from the op's keyword arguments (None: the template's value)."""
    knobs = {"path": path, "max_recv_tokens": max_recv_tokens}
    return {k: v for k, v in knobs.items() if v is not None} or None


def _moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts, *, path=None,
             max_recv_tokens=None):  # fmt: skip
    return moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, group_of(group_name), num_experts=num_experts,
                   config=moe_config(path, max_recv_tokens))  # fmt: skip


for _name, _fn in [("ag_gemm", _ag_gemm), ("gemm_rs", _gemm_rs), ("gemm_ar", _gemm_ar),
                   ("ag_gemm_out", _ag_gemm_out), ("gemm_rs_out", _gemm_rs_out), ("gemm_ar_out", _gemm_ar_out),
                   ("all_gather", _all_gather), ("reduce_scatter", _reduce_scatter), ("moe_mlp", _moe_mlp)]:  # fmt: skip
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _fn, _key)


# ---- fakes: shapes from the arguments and the group, no communication ----------


def rs_rows(m, group_name: str):
    """Rows of an [m, N] product that this rank owns after gemm_rs (uneven M: per rank)."""
    world = c10d._get_group_size_by_name(group_name)
    start, stop = segment(dist.get_rank(group_of(group_name)), m, world)
    return stop - start


@torch.library.register_fake(f"{NAMESPACE}::ag_gemm")
def _ag_gemm_fake(x, w, group_name, *, return_gathered=False):
    rows = x.shape[0] * c10d._get_group_size_by_name(group_name)
    gathered = x.new_empty((rows, x.shape[1])) if return_gathered else None
    return x.new_empty((rows, w.shape[1])), gathered


@torch.library.register_fake(f"{NAMESPACE}::gemm_rs")
def _gemm_rs_fake(x, w, group_name, reduce_op="sum"):
    return x.new_empty((rs_rows(x.shape[0], group_name), w.shape[1]))


@torch.library.register_fake(f"{NAMESPACE}::gemm_ar")
def _gemm_ar_fake(x, w, group_name):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.register_fake(f"{NAMESPACE}::all_gather")
def _all_gather_fake(x, group_name):
    return x.new_empty((x.shape[0] * c10d._get_group_size_by_name(group_name), *x.shape[1:]))


@torch.library.register_fake(f"{NAMESPACE}::reduce_scatter")
def _reduce_scatter_fake(x, group_name):
    return x.new_empty((rs_rows(x.shape[0], group_name), *x.shape[1:]))


@torch.library.register_fake(f"{NAMESPACE}::moe_mlp")
def _moe_mlp_fake(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts, *, path=None,
                  max_recv_tokens=None):  # fmt: skip
    return x.new_empty((x.shape[0], w_down.shape[2]))  # [T, H]: each token's combined output


for _name in ("ag_gemm_out", "gemm_rs_out", "gemm_ar_out"):
    torch.library.register_fake(f"{NAMESPACE}::{_name}", lambda *args, **kwargs: None)
