"""The fused ops as PyTorch custom ops: ``torch.ops.overlap_kernels.*``.

Registered with ``torch.library.Library.define`` + ``impl`` (the cheaper
dispatch path: a ``custom_op`` costs several times as much per call), with a
fake implementation each, so that ``torch.compile(fullgraph=True)`` traces
them. The group travels as its name (``group.group_name``), as PyTorch's own
symmetric-memory ops take it::

    ag_gemm(Tensor x, Tensor w, str group_name, *, bool return_gathered=False) -> (Tensor, Tensor?)
    gemm_rs(Tensor x, Tensor w, str group_name, str reduce_op="sum") -> Tensor
    gemm_ar(Tensor x, Tensor w, str group_name) -> Tensor
    all_reduce(Tensor x, str group_name) -> Tensor
    all_reduce_rmsnorm(Tensor x, Tensor? residual, Tensor norm_weight, float eps, str group_name)
        -> (Tensor normed, Tensor residual_out)
    gemm_ar_rmsnorm(Tensor x, Tensor w, Tensor? residual, Tensor norm_weight, float eps,
                    str group_name) -> (Tensor normed, Tensor residual_out)
    ag_gemm_out / gemm_rs_out / gemm_ar_out(..., *, Tensor(a!) out) -> ()
    all_gather(Tensor x, str group_name) -> Tensor        # the backward formulas' collectives
    reduce_scatter(Tensor x, str group_name) -> Tensor    # (sum; gemm_rs's slices)
    ag_gemm_regathered_grads(Tensor dy, Tensor x, Tensor w, str group_name) -> (Tensor dx, Tensor dw)
    moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down,
            str group_name, int num_experts, *, str? path=None, int? max_recv_tokens=None,
            int? max_tokens_per_rank=None) -> Tensor
    moe_dispatch(Tensor x, Tensor topk_ids, Tensor topk_weights, str group_name, int num_experts, *,
                 int? max_recv_tokens=None, float? timeout_s=None)
        -> (Tensor recv_x, Tensor recv_weights, Tensor expert_counts, <route>)
    moe_combine(Tensor y, Tensor recv_weights, Tensor topk_weights, Tensor topk_ids, <route>,
                str group_name, *, float? timeout_s=None) -> Tensor
    moe_combine_backward(Tensor grad_out, Tensor? y, Tensor recv_weights, Tensor topk_weights,
                         Tensor topk_ids, <route>, str group_name, *, bool dy=True, bool dw=True,
                         float? timeout_s=None) -> (Tensor?, Tensor?)
    <route> = Tensor route_counts, Tensor row_in_block, Tensor token_rows, Tensor slot_of_row

Shapes and meaning are those of :func:`overlap_kernels.ag_gemm`,
:func:`~overlap_kernels.gemm_rs`, :func:`~overlap_kernels.gemm_ar`,
:func:`~overlap_kernels.all_reduce`, :func:`~overlap_kernels.all_reduce_rmsnorm`,
:func:`~overlap_kernels.gemm_ar_rmsnorm` and :func:`~overlap_kernels.moe_mlp`
(the all-reduce ops with their template's config: a model sets no knob per layer); the ``_out`` variants write into ``out``
(declared mutated). ``moe_mlp``'s ``config`` is reduced to the two knobs a
model sets per layer, ``path`` ("auto", "fused", "unfused") and the capacity
``max_recv_tokens``; None takes the template's value, and every other knob
comes from the template and the tuned tables. Its ``max_tokens_per_rank`` runs
the graph mode, which a CUDA graph holds (:func:`overlap_kernels.moe_mlp`). Every op is tagged
``needs_fixed_stride_order``: the kernels read row-major x.

``moe_dispatch`` / ``moe_combine`` are :func:`overlap_kernels.moe_dispatch` /
:func:`~overlap_kernels.moe_combine` with the handle as tensors: recv_x [R, H],
recv_weights fp32 [R] (each row's routing weight), expert_counts int64
[E_local] (rows per local expert) and the route, which combine takes back:
the count matrix int64 [W, *] and the experts' counts are on the host, where
the dispatch's one host round trip put them (no device sync to read them),
row_in_block int64 [T, W], token_rows and slot_of_row int64 [R]. R is known
only after the count exchange: the fake gives an unbacked size, so
``torch.compile(fullgraph=True)`` traces the pair (without fullgraph, the graph
breaks at the dispatch unless ``capture_dynamic_output_shape_ops`` is set).
``moe_combine`` weights rows by recv_weights and takes topk_weights and
topk_ids only for its gradient; ``moe_combine_backward`` computes that gradient
(it dispatches grad_out again with topk_ids; y is needed for dw only). Knobs: None takes the template's.

Gradients: :mod:`overlap_kernels.integrations.autograd` registers them;
``moe_dispatch``'s and ``moe_combine``'s, :mod:`~overlap_kernels.integrations.functional`
(its MoE section has the formulas).
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
from ..ops.all_reduce import all_reduce, all_reduce_rmsnorm
from ..ops.gemm_ar import gemm_ar
from ..ops.gemm_ar_rmsnorm import gemm_ar_rmsnorm
from ..ops.gemm_rs import gemm_rs, reduce_scatter_rows, start_reduce_scatter_rows
from ..ops.moe import _combine_handle, _handle_tensors, moe_combine, moe_dispatch, moe_mlp
from ..ops.moe_details.layout import counts_row_len
from ..ops.reduce_details.plan import segment
from ..runtime.collectives import all_gather_single, collective, start_collective
from ..runtime.errors import OverlapInputError

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
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor", tags=_TAGS)
_lib.define(
    "all_reduce_rmsnorm(Tensor x, Tensor? residual, Tensor norm_weight, float eps, str group_name) "
    "-> (Tensor normed, Tensor residual_out)",
    tags=_TAGS,
)
_lib.define(
    "gemm_ar_rmsnorm(Tensor x, Tensor w, Tensor? residual, Tensor norm_weight, float eps, "
    "str group_name) -> (Tensor normed, Tensor residual_out)",
    tags=_TAGS,
)
_lib.define("ag_gemm_out(Tensor x, Tensor w, str group_name, *, Tensor(a!) out) -> ()", tags=_TAGS)
_lib.define(
    'gemm_rs_out(Tensor x, Tensor w, str group_name, str reduce_op="sum", *, Tensor(a!) out) -> ()',
    tags=_TAGS,
)
_lib.define("gemm_ar_out(Tensor x, Tensor w, str group_name, *, Tensor(a!) out) -> ()", tags=_TAGS)
_lib.define("all_gather(Tensor x, str group_name) -> Tensor")
_lib.define("reduce_scatter(Tensor x, str group_name) -> Tensor")
_lib.define(
    "ag_gemm_regathered_grads(Tensor dy, Tensor x, Tensor w, str group_name) -> (Tensor dx, Tensor dw)"
)
_lib.define(
    "moe_mlp(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
    "str group_name, int num_experts, *, str? path=None, int? max_recv_tokens=None, "
    "int? max_tokens_per_rank=None) -> Tensor",
    tags=_TAGS,
)
# A dispatch travels to its combine as these tensors (ops/moe.py's _handle_tensors).
_ROUTE = "Tensor route_counts, Tensor row_in_block, Tensor token_rows, Tensor slot_of_row"
_lib.define(
    "moe_dispatch(Tensor x, Tensor topk_ids, Tensor topk_weights, str group_name, int num_experts, *, "
    "int? max_recv_tokens=None, float? timeout_s=None) -> "
    f"(Tensor recv_x, Tensor recv_weights, Tensor expert_counts, {_ROUTE})",
    tags=_TAGS,
)
_lib.define(
    f"moe_combine(Tensor y, Tensor recv_weights, Tensor topk_weights, Tensor topk_ids, {_ROUTE}, "
    "str group_name, *, float? timeout_s=None) -> Tensor",
    tags=_TAGS,
)
_lib.define(
    "moe_combine_backward(Tensor grad_out, Tensor? y, Tensor recv_weights, Tensor topk_weights, "
    f"Tensor topk_ids, {_ROUTE}, str group_name, *, bool dy=True, bool dw=True, "
    "float? timeout_s=None) -> (Tensor?, Tensor?)",
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


def _all_reduce(x, group_name):
    return all_reduce(x, group_of(group_name))


def _all_reduce_rmsnorm(x, residual, norm_weight, eps, group_name):
    return all_reduce_rmsnorm(x, residual, norm_weight, eps, group_of(group_name))


def _gemm_ar_rmsnorm(x, w, residual, norm_weight, eps, group_name):
    return gemm_ar_rmsnorm(x, w, residual, norm_weight, eps, group_of(group_name))


def _ag_gemm_out(x, w, group_name, *, out):
    ag_gemm(x, w, group_of(group_name), out=out)


def _gemm_rs_out(x, w, group_name, reduce_op="sum", *, out):
    gemm_rs(x, w, group_of(group_name), out=out, reduce_op=reduce_op)


def _gemm_ar_out(x, w, group_name, *, out):
    gemm_ar(x, w, group_of(group_name), out=out)


# The backward formulas' collectives (integrations/autograd.py): c10d's, through
# the wrappers the ops' plain paths use, so a missing peer fails them past a
# deadline (the default timeout_s) on gloo and NCCL groups alike (runtime/collectives.py).


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


def _ag_gemm_regathered_grads(dy, x, w, group_name):
    """ag_gemm's dx and dw where its forward kept x, not the gathered x: the
    re-gather runs beside the dx product, and dx's reduce-scatter beside the
    dw product (Megatron's order). Plain collectives, not our spinning kernels:
    an NCCL kernel beside a kernel that waits for peers could wait for SMs it holds."""
    group = group_of(group_name)
    gathered = x.new_empty((x.shape[0] * dist.get_world_size(group), x.shape[1]))
    gathered_ready = start_collective("ag_gemm backward", "all-gather", all_gather_single, gathered,
                                      x.contiguous(), group=group)  # fmt: skip
    dx_full = dy @ w.t()
    gathered_ready()
    dx_ready = start_reduce_scatter_rows(dx_full, group, x.new_empty(x.shape))
    dw = gathered.t() @ dy
    return dx_ready(), dw


def moe_config(**knobs) -> dict | None:
    """A MoE op's config from the custom op's keyword arguments (None: the template's value)."""
    return {k: v for k, v in knobs.items() if v is not None} or None


def _moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts, *, path=None,
             max_recv_tokens=None, max_tokens_per_rank=None):  # fmt: skip
    return moe_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, group_of(group_name), num_experts=num_experts,
                   config=moe_config(path=path, max_recv_tokens=max_recv_tokens),
                   max_tokens_per_rank=max_tokens_per_rank)  # fmt: skip


# The MoE ops' implementations are never traced: compiled without fullgraph (and
# without capture_dynamic_output_shape_ops), Dynamo breaks the graph at
# moe_dispatch, whose row count is data-dependent, and runs it eagerly, as it
# runs any frame it gives up on; it must not then trace the implementation (down
# to the Triton interpreter's frames on CPU).
@torch.compiler.disable
def _moe_dispatch(x, topk_ids, topk_weights, group_name, num_experts, *, max_recv_tokens=None,
                  timeout_s=None):  # fmt: skip
    config = moe_config(max_recv_tokens=max_recv_tokens, timeout_s=timeout_s)
    recv_x, handle = moe_dispatch(x, topk_ids, topk_weights, group_of(group_name), num_experts=num_experts,
                                  config=config)  # fmt: skip
    expert_counts = torch.tensor(handle.expert_counts, dtype=torch.int64)  # on the host, as known
    return recv_x, handle.recv_weights, expert_counts, *_handle_tensors(handle)


@torch.compiler.disable
def _moe_combine(y, recv_weights, topk_weights, topk_ids, route_counts, row_in_block, token_rows, slot_of_row,
                 group_name, *, timeout_s=None):  # fmt: skip
    handle = _combine_handle(route_counts, row_in_block, token_rows, slot_of_row, recv_weights,
                             group_of(group_name), moe_config(timeout_s=timeout_s), y.dtype)  # fmt: skip
    return moe_combine(y, handle)


@torch.compiler.disable
def _moe_combine_backward(grad_out, y, recv_weights, topk_weights, topk_ids, route_counts, row_in_block,
                          token_rows, slot_of_row, group_name, *, dy=True, dw=True, timeout_s=None):  # fmt: skip
    """The gradients of out = moe_combine(y, weights) (formulas: functional.py's MoE section)."""
    if dw and y is None:
        raise OverlapInputError("moe_combine_backward: dw needs the forward's y")
    group, config = group_of(group_name), moe_config(timeout_s=timeout_s)
    ones = torch.ones_like(recv_weights)  # unit weights: the combine sums a token's rows
    unit = _combine_handle(route_counts, row_in_block, token_rows, slot_of_row, ones, group, config,
                           grad_out.dtype)  # fmt: skip
    # Each row's token's output gradient: the forward's routing dispatched again.
    num_experts = len(unit.expert_counts) * dist.get_world_size(group)
    g_rows, _ = moe_dispatch(grad_out.contiguous(), topk_ids, topk_weights, group, num_experts=num_experts,
                             config=config)  # fmt: skip
    if g_rows.shape[0] != recv_weights.shape[0]:
        raise OverlapInputError(
            f"moe_combine backward: the routing dispatched again gives {g_rows.shape[0]} rows here, "
            f"the forward had {recv_weights.shape[0]}: topk_ids changed in between"
        )
    d_y = d_w = None
    if dy:
        d_y = (g_rows.float() * recv_weights[:, None]).to(grad_out.dtype)
    if dw:
        products = (y.float() * g_rows.float()).sum(1)  # [R]: <y_i, D(dout)_i>
        # One column per top-k slot, as wide as the largest k of any rank (every rank combines one width).
        per_slot = products.new_zeros(products.shape[0], unit.max_topk)
        per_slot[torch.arange(products.shape[0], device=products.device), slot_of_row] = products
        d_w = moe_combine(per_slot, unit)[:, : topk_ids.shape[1]].to(topk_weights.dtype)
    return d_y, d_w


for _name, _fn in [("ag_gemm", _ag_gemm), ("gemm_rs", _gemm_rs), ("gemm_ar", _gemm_ar),
                   ("all_reduce", _all_reduce), ("all_reduce_rmsnorm", _all_reduce_rmsnorm),
                   ("gemm_ar_rmsnorm", _gemm_ar_rmsnorm),
                   ("ag_gemm_out", _ag_gemm_out), ("gemm_rs_out", _gemm_rs_out), ("gemm_ar_out", _gemm_ar_out),
                   ("all_gather", _all_gather), ("reduce_scatter", _reduce_scatter),
                   ("ag_gemm_regathered_grads", _ag_gemm_regathered_grads), ("moe_mlp", _moe_mlp),
                   ("moe_dispatch", _moe_dispatch), ("moe_combine", _moe_combine),
                   ("moe_combine_backward", _moe_combine_backward)]:  # fmt: skip
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _fn, _key)


# ---- fakes: shapes from the arguments and the group, no communication ----------


def rs_rows(m: int | torch.SymInt, group_name: str) -> int | torch.SymInt:
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


@torch.library.register_fake(f"{NAMESPACE}::all_reduce")
def _all_reduce_fake(x, group_name):
    return x.new_empty(x.shape)


@torch.library.register_fake(f"{NAMESPACE}::all_reduce_rmsnorm")
def _all_reduce_rmsnorm_fake(x, residual, norm_weight, eps, group_name):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake(f"{NAMESPACE}::gemm_ar_rmsnorm")
def _gemm_ar_rmsnorm_fake(x, w, residual, norm_weight, eps, group_name):
    shape = (x.shape[0], w.shape[1])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.register_fake(f"{NAMESPACE}::all_gather")
def _all_gather_fake(x, group_name):
    return x.new_empty((x.shape[0] * c10d._get_group_size_by_name(group_name), *x.shape[1:]))


@torch.library.register_fake(f"{NAMESPACE}::reduce_scatter")
def _reduce_scatter_fake(x, group_name):
    return x.new_empty((rs_rows(x.shape[0], group_name), *x.shape[1:]))


@torch.library.register_fake(f"{NAMESPACE}::ag_gemm_regathered_grads")
def _ag_gemm_regathered_grads_fake(dy, x, w, group_name):
    return x.new_empty(x.shape), x.new_empty((x.shape[1], dy.shape[1]))


@torch.library.register_fake(f"{NAMESPACE}::moe_mlp")
def _moe_mlp_fake(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts, *, path=None,
                  max_recv_tokens=None, max_tokens_per_rank=None):  # fmt: skip
    return x.new_empty((x.shape[0], w_down.shape[2]))  # [T, H]: each token's combined output


@torch.library.register_fake(f"{NAMESPACE}::moe_dispatch")
def _moe_dispatch_fake(x, topk_ids, topk_weights, group_name, num_experts, *, max_recv_tokens=None,
                       timeout_s=None):  # fmt: skip
    world = c10d._get_group_size_by_name(group_name)
    rows = torch.library.get_ctx().new_dynamic_size()  # R: known after the count exchange
    on_host = torch.empty((world, counts_row_len(world, num_experts)), dtype=torch.int64)
    return (
        x.new_empty((rows, x.shape[1])),  # recv_x
        x.new_empty((rows,), dtype=torch.float32),  # recv_weights
        torch.empty((num_experts // world,), dtype=torch.int64),  # expert_counts (host)
        on_host,  # route_counts
        x.new_empty((x.shape[0], world), dtype=torch.int64),  # row_in_block
        *(x.new_empty((rows,), dtype=torch.int64) for _ in range(2)),  # token_rows, slot_of_row
    )


@torch.library.register_fake(f"{NAMESPACE}::moe_combine")
def _moe_combine_fake(y, recv_weights, topk_weights, topk_ids, route_counts, row_in_block, token_rows,
                      slot_of_row, group_name, *, timeout_s=None):  # fmt: skip
    return y.new_empty((row_in_block.shape[0], y.shape[1]))  # [T, N]


@torch.library.register_fake(f"{NAMESPACE}::moe_combine_backward")
def _moe_combine_backward_fake(grad_out, y, recv_weights, topk_weights, topk_ids, route_counts, row_in_block,
                               token_rows, slot_of_row, group_name, *, dy=True, dw=True,
                               timeout_s=None):  # fmt: skip
    d_y = grad_out.new_empty((recv_weights.shape[0], grad_out.shape[1])) if dy else None
    return d_y, (torch.empty_like(topk_weights) if dw else None)


for _name in ("ag_gemm_out", "gemm_rs_out", "gemm_ar_out"):
    torch.library.register_fake(f"{NAMESPACE}::{_name}", lambda *args, **kwargs: None)
