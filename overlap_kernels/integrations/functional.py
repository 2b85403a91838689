"""Tensor-parallel linear layers as functions, for code without DTensor.

``weight`` is an nn.Linear weight [N, K] (this rank's shard), ``bias`` [N]
or None; ``group`` a process group (None: the default one).

- ``linear_ag(x, weight, bias, group)``: column-parallel with sequence
  parallelism: x [T_local, K] (this rank's tokens) -> [T_local * W, N].
- ``linear_rs(x, weight, bias, group)``: row-parallel with sequence
  parallelism: x [T, K_local] -> this rank's tokens [T / W, N] of the sum.
  The bias goes onto this rank's rows, so its gradient is this rank's part
  of the sum over all rows: sum it over the group, as Megatron does for its
  sequence-parallel parameters (dtensor.py's style does it itself).
- ``linear_ar(x, weight, bias, group)``: row-parallel, replicated output:
  x [..., K_local] -> [..., N], the sum over ranks, on every rank.

Differentiable in x, weight and bias (integrations/autograd.py). In eager
mode with no gradient to record they call the op's Python function directly
(the dispatcher would only add host time); under torch.compile, or where
autograd records, they go through ``torch.ops.overlap_kernels``.

MoE (expert parallelism; the section at the end of this file):

- ``moe_dispatch(x, topk_ids, topk_weights, group, num_experts=...)`` ->
  ``(recv_x, handle)``, differentiable in x; ``moe_combine(y, handle)``,
  differentiable in y and in the dispatch's ``topk_weights``. Each is the
  other's backward: the formulas are in the section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..ops import moe as moe_ops
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


# ==== MoE: differentiable dispatch and combine ===================================
#
# With rows i of recv_x (one per routed pair: token t of rank s, slot j, its
# expert's rank), w_i = topk_weights_s[t, j] and D(u)_i = u_s[t] (dispatch
# copies a token's row to each of its pairs):
#
#   forward   recv_x = D(x)                    out[t] = sum_{i of t} w_i y_i
#   backward  dx[t] = sum_{i of t} drecv_x_i   dy_i = w_i D(dout)_i
#                                              dw[t, j] = <y_i, D(dout)_i>  (i: the pair of (t, j))
#
# so the adjoint of a dispatch is a combine with unit weights and that of a
# combine a dispatch of the output gradient, scaled per row. Both run the
# library's own ops: moe_combine on a copy of the handle whose weights are
# ones (the op reads its weights from the handle and has no unweighted form),
# and moe_dispatch of the gradient with the forward's routing (the same
# topk_ids give the same rows in the same order; it exchanges the counts
# again). dw's per-slot dot products travel home as a moe_combine of a
# [rows, k] table holding each row's product in its slot's column: exactly
# one nonzero per (t, j), so the fp32 sums are exact. Unused slots (-1) get 0.
#
# The ops are collectives, and so are these backwards: every rank must ask for
# the same gradients (x's, y's, topk_weights'), or a rank waits alone until
# the config's timeout. Under torch.compile the two functions run eagerly (a
# graph break): their row counts are known only after the count exchange.


@dataclass(frozen=True, eq=False)  # (compared by identity: it holds tensors)
class MoeDispatchHandle:
    """``moe_dispatch``'s handle: the op's :class:`~overlap_kernels.ops.moe.MoeHandle`
    and the routing the gradients dispatch with again."""

    handle: moe_ops.MoeHandle
    topk_ids: torch.Tensor  # [T, k]
    topk_weights: torch.Tensor  # [T, k], as passed: combine's weight gradient flows into it
    group: dist.ProcessGroup | None
    num_experts: int
    config: moe_ops.MoeConfig | dict | None

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Rows of recv_x per local expert."""
        return self.handle.expert_counts

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens


def _unit_weights(handle: moe_ops.MoeHandle) -> moe_ops.MoeHandle:
    """The handle with every row's weight 1.0: moe_combine then sums a token's rows."""
    return dataclasses.replace(handle, recv_weights=torch.ones_like(handle.recv_weights))


def _dispatch_again(g: torch.Tensor, dh: MoeDispatchHandle) -> torch.Tensor:
    """g [T, N] (a gradient at the tokens' home) -> [R, N] in the forward's rows."""
    rows, _ = moe_ops.moe_dispatch(g.contiguous(), dh.topk_ids, dh.topk_weights.detach(), dh.group,
                                   num_experts=dh.num_experts, config=dh.config)  # fmt: skip
    return rows


class _MoeDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, group, num_experts, config):
        recv_x, handle = moe_ops.moe_dispatch(x, topk_ids, topk_weights, group,
                                              num_experts=num_experts, config=config)  # fmt: skip
        ctx.handle = handle
        return recv_x, handle

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_recv_x, _grad_handle):
        dx = moe_ops.moe_combine(grad_recv_x.contiguous(), _unit_weights(ctx.handle))
        return dx, None, None, None, None, None


class _MoeCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, dh: MoeDispatchHandle):
        ctx.dh = dh
        ctx.save_for_backward(y if ctx.needs_input_grad[1] else None)
        return moe_ops.moe_combine(y, dh.handle)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dh, (y,) = ctx.dh, ctx.saved_tensors
        handle = dh.handle
        g_rows = _dispatch_again(grad_out, dh)  # [R, N]: each row's token's output gradient
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = (g_rows.float() * handle.recv_weights[:, None]).to(g_rows.dtype)
        if ctx.needs_input_grad[1]:
            products = (y.float() * g_rows.float()).sum(1)  # [R]: <y_i, D(dout)_i>
            # Every rank combines the same width: the largest k of any rank.
            width = handle._route.layout.max_topk
            per_slot = products.new_zeros(products.shape[0], width)
            per_slot[
                torch.arange(products.shape[0], device=products.device), handle._slot_of_row
            ] = products
            dw = moe_ops.moe_combine(per_slot, _unit_weights(handle))[:, : dh.topk_ids.shape[1]]
            dw = dw.to(dh.topk_weights.dtype)
        return dy, dw, None


@torch.compiler.disable
def moe_dispatch(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: moe_ops.MoeConfig | dict | None = None,
) -> tuple[torch.Tensor, MoeDispatchHandle]:
    """:func:`overlap_kernels.moe_dispatch`, differentiable in x: (recv_x [R, H], handle).
    Run the experts on recv_x's rows (``handle.expert_counts`` per local expert),
    then :func:`moe_combine`. ``topk_weights`` get their gradient from the combine."""
    weights = topk_weights.detach()  # the op only carries them; moe_combine differentiates
    if torch.is_grad_enabled() and x.requires_grad:
        recv_x, handle = _MoeDispatch.apply(x, topk_ids, weights, group, num_experts, config)
    else:
        recv_x, handle = moe_ops.moe_dispatch(
            x, topk_ids, weights, group, num_experts=num_experts, config=config
        )
    return recv_x, MoeDispatchHandle(handle, topk_ids, topk_weights, group, num_experts, config)


@torch.compiler.disable
def moe_combine(y: torch.Tensor, handle: MoeDispatchHandle) -> torch.Tensor:
    """:func:`overlap_kernels.moe_combine`: out [T, N] = the sum over each token's
    slots of weight * y, differentiable in y and in the dispatch's topk_weights.
    ``handle``: :func:`moe_dispatch`'s (an op's plain MoeHandle only where
    nothing is differentiated)."""
    if isinstance(handle, MoeDispatchHandle):
        if torch.is_grad_enabled() and (y.requires_grad or handle.topk_weights.requires_grad):
            return _MoeCombine.apply(y, handle.topk_weights, handle)
        return moe_ops.moe_combine(y, handle.handle)
    if torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad:
        raise OverlapInputError(
            "moe_combine: y requires grad, and its backward dispatches the gradient again with the "
            "forward's routing, which a plain MoeHandle does not keep: dispatch with "
            "overlap_kernels.integrations.functional.moe_dispatch and pass its handle"
        )
    return moe_ops.moe_combine(y, handle)
