"""Gradients of the custom ops (torch_ops.py), registered with
``torch.library.register_autograd`` so that eager autograd and AOTAutograd
(torch.compile) use the same formulas. ``w`` is [K, N]; W is the group size.

===========  ===============================  ===================================  ==========================
op           forward                          dx                                   dw
===========  ===============================  ===================================  ==========================
ag_gemm      out = AG(x) @ w                  gemm_rs(dy, w^T): RS(dy @ w^T) [*]   AG(x)^T @ dy
gemm_rs      out = RS(x @ w) (rows of rank)   ag_gemm(dy, w^T, return_gathered)    x^T @ AG(dy)
gemm_ar      out = AR(x @ w)                  dy @ w^T                             x^T @ dy
===========  ===============================  ===================================  ==========================

[*] or, where x alone was kept, ``dy @ w^T`` then NCCL's reduce-scatter (below).

- ag_gemm's dw needs the gathered x. A forward that returned it
  (``return_gathered``) keeps it for backward: then the backward's only
  communication is inside gemm_rs. The layers ask for that by default
  (``keep_gathered=True``, the memory torch's own TP styles spend on it). A
  forward that did not keeps x alone (W times less memory) and
  ``ag_gemm_regathered_grads`` gathers it again beside the dx product
  (torch_ops.py), as Megatron does.
- gemm_rs's backward gathers the output gradient with the dx GEMM and reuses
  the gathered gradient for dw: no extra communication. Its slices are equal
  only where W divides M; other M raise before anything is sent.
- gemm_ar's output is replicated and so is its gradient (as in Megatron's
  row-parallel layer): its backward is local, no communication.
- Gradients may arrive non-contiguous (``y.sum().backward()`` expands one):
  they are made contiguous first.

``moe_mlp`` has no gradient: its autograd kernel raises OverlapInputError,
before anything is sent, where an operand requires grad in grad mode (a
backward would need the dispatch's rows and the gate/up GEMM's output, which
the fused op does not keep). The differentiable MoE layer is
``functional.moe_dispatch`` -> the caller's experts -> ``functional.moe_combine``.
"""

from __future__ import annotations

import torch
from torch.distributed import distributed_c10d as c10d

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..runtime.errors import OverlapInputError
from .torch_ops import NAMESPACE

_ops = torch.ops.overlap_kernels


# ---- ag_gemm -------------------------------------------------------------------


def _ag_gemm_setup(ctx, inputs, keyword_only_inputs, output):
    x, w, group_name = inputs
    gathered = output[1]
    ctx.group_name = group_name
    ctx.kept_gathered = gathered is not None
    ctx.save_for_backward(w, gathered if gathered is not None else x)
    # A gathered x returned only to be kept gets no gradient: None, not zeros to reduce-scatter.
    ctx.set_materialize_grads(False)


def _ag_gemm_backward(ctx, grad_out, grad_gathered):
    w, x_or_gathered = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx = dw = None
    if grad_out is not None:
        dy = grad_out.contiguous()
        if need_dx and need_dw and not ctx.kept_gathered:
            dx, dw = _ops.ag_gemm_regathered_grads(dy, x_or_gathered, w, ctx.group_name)
        else:
            if need_dx:
                dx = _ops.gemm_rs(dy, w.t(), ctx.group_name)
            if need_dw:
                gathered = x_or_gathered
                if not ctx.kept_gathered:
                    gathered = _ops.all_gather(x_or_gathered, ctx.group_name)
                dw = gathered.t() @ dy
    if need_dx and grad_gathered is not None:  # the gathered x was used downstream too
        scattered = _ops.reduce_scatter(grad_gathered.contiguous(), ctx.group_name)
        dx = scattered if dx is None else dx + scattered
    return dx, dw, None


# ---- gemm_rs -------------------------------------------------------------------


def _gemm_rs_setup(ctx, inputs, output):
    x, w, group_name, reduce_op = inputs
    ctx.group_name, ctx.reduce_op = group_name, reduce_op
    ctx.save_for_backward(x, w)


def _gemm_rs_backward(ctx, grad_out):
    x, w = ctx.saved_tensors
    world = c10d._get_group_size_by_name(ctx.group_name)
    if x.shape[0] % world:
        raise OverlapInputError(
            f"gemm_rs backward: the output gradient is gathered from equal slices, so M = {x.shape[0]} "
            f"must divide by the group size {world}"
        )
    dx_all, dy_all = _ops.ag_gemm(
        grad_out.contiguous(), w.t(), ctx.group_name, return_gathered=True
    )
    if ctx.reduce_op == "avg":
        dx_all, dy_all = dx_all / world, dy_all / world
    dx = dx_all if ctx.needs_input_grad[0] else None
    dw = x.t() @ dy_all if ctx.needs_input_grad[1] else None
    return dx, dw, None, None


# ---- gemm_ar -------------------------------------------------------------------


def _gemm_ar_setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w)


def _gemm_ar_backward(ctx, grad_out):
    x, w = ctx.saved_tensors
    dy = grad_out.contiguous()
    dx = dy @ w.t() if ctx.needs_input_grad[0] else None
    dw = x.t() @ dy if ctx.needs_input_grad[1] else None
    return dx, dw, None


# ---- moe_mlp: refused under autograd -------------------------------------------


def _moe_mlp_autograd(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts, *, path=None,
                      max_recv_tokens=None, max_tokens_per_rank=None):  # fmt: skip
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w_gate_up, w_down)
    ):
        raise OverlapInputError(
            "moe_mlp: an operand requires grad, and moe_mlp records no gradient: use "
            "overlap_kernels.integrations.functional.moe_dispatch, your experts, then moe_combine "
            "(differentiable), or call it under torch.no_grad()"
        )
    with torch._C._AutoDispatchBelowAutograd():
        return _ops.moe_mlp.default(x, topk_ids, topk_weights, w_gate_up, w_down, group_name, num_experts,
                                    path=path, max_recv_tokens=max_recv_tokens,
                                    max_tokens_per_rank=max_tokens_per_rank)  # fmt: skip


_lib = torch.library.Library(NAMESPACE, "IMPL")
_lib.impl("moe_mlp", _moe_mlp_autograd, "Autograd")

torch.library.register_autograd(
    f"{NAMESPACE}::ag_gemm", _ag_gemm_backward, setup_context=_ag_gemm_setup
)
torch.library.register_autograd(
    f"{NAMESPACE}::gemm_rs", _gemm_rs_backward, setup_context=_gemm_rs_setup
)
torch.library.register_autograd(
    f"{NAMESPACE}::gemm_ar", _gemm_ar_backward, setup_context=_gemm_ar_setup
)
