"""Tensor-parallel linear layers as functions, for code without DTensor.

``weight`` is an nn.Linear weight [N, K] (this rank's shard), ``bias`` [N]
or None; ``group`` a process group (None: the default one).

- ``linear_ag(x, weight, bias, group, keep_gathered=True)``: column-parallel
  with sequence parallelism: x [T_local, K] (this rank's tokens) ->
  [T_local * W, N]. Where autograd records, the gathered x [T_local * W, K]
  is kept for the weight's gradient (as torch's TP styles keep it); with
  ``keep_gathered=False`` only x is kept and backward gathers it again beside
  its dx product (Megatron's choice: W times less activation memory).
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
  differentiable in y and in the dispatch's ``topk_weights``. They run the
  custom ops ``torch.ops.overlap_kernels.moe_dispatch`` / ``moe_combine``
  (torch_ops.py), whose gradients this module registers: each is the other's
  backward (the formulas are in the section). Under
  ``torch.compile(fullgraph=True)`` they trace, recv_x's row count an unbacked
  size; the experts find their rows with ``handle.expert_counts`` (host ints)
  or ``handle.expert_counts_tensor``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
              group: dist.ProcessGroup | None = None, *, keep_gathered: bool = True) -> torch.Tensor:  # fmt: skip
    _two_d("linear_ag", x)
    if _dispatched(x, weight):
        # (the gathered x kept for dweight, or x alone and gathered again: autograd.py)
        keep = keep_gathered and torch.is_grad_enabled() and weight.requires_grad
        y = _ops.ag_gemm(x, weight.t(), name_of(group), return_gathered=keep)[0]
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
# combine a dispatch of the output gradient, scaled per row. Both are the
# custom ops (torch_ops.py), which carry the dispatch as tensors: moe_dispatch's
# backward is the moe_combine op with ones for its per-row weights, and
# moe_combine's is moe_combine_backward, which dispatches the gradient with the
# forward's routing (the same topk_ids give the same rows in the same order; it
# exchanges the counts again). dw's per-slot dot products travel home as a
# moe_combine of a [rows, k] table holding each row's product in its slot's
# column: exactly one nonzero per (t, j), so the fp32 sums are exact. Unused
# slots (-1) get 0. moe_combine takes topk_weights only for that gradient (it
# reads the dispatch's recv_weights, the same values per row).
#
# The ops are collectives, and so are these backwards: every rank must ask for
# the same gradients (x's, y's, topk_weights'), or a rank waits alone until
# the config's timeout. Under torch.compile the ops trace: recv_x's row count is
# an unbacked size (known only after the count exchange).


def _moe_dispatch_setup(ctx, inputs, keyword_only_inputs, output):
    _, topk_ids, topk_weights, group_name, _ = inputs
    _, recv_weights, _, *route = output
    ctx.mark_non_differentiable(recv_weights)
    ctx.group_name, ctx.timeout_s = group_name, keyword_only_inputs.get("timeout_s")
    ctx.save_for_backward(recv_weights, topk_weights, topk_ids, *route)


def _moe_dispatch_backward(ctx, grad_recv_x, *_):
    recv_weights, topk_weights, topk_ids, *route = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0] and grad_recv_x is not None:
        dx = _ops.moe_combine(grad_recv_x.contiguous(), torch.ones_like(recv_weights), topk_weights, topk_ids,
                              *route, ctx.group_name, timeout_s=ctx.timeout_s)  # fmt: skip
    return dx, None, None, None, None


def _moe_combine_setup(ctx, inputs, keyword_only_inputs, output):
    y, *saved, group_name = inputs  # saved: recv_weights, topk_weights, topk_ids, route
    ctx.group_name, ctx.timeout_s = group_name, keyword_only_inputs.get("timeout_s")
    ctx.save_for_backward(y if ctx.needs_input_grad[2] else None, *saved)  # y: for dw only


def _moe_combine_backward(ctx, grad_out):
    need_dy, _, need_dw = ctx.needs_input_grad[:3]
    dy, dw = _ops.moe_combine_backward(grad_out, *ctx.saved_tensors, ctx.group_name, dy=need_dy,
                                       dw=need_dw, timeout_s=ctx.timeout_s)  # fmt: skip
    return dy, None, dw, None, None, None, None, None, None


torch.library.register_autograd(
    "overlap_kernels::moe_dispatch", _moe_dispatch_backward, setup_context=_moe_dispatch_setup
)
torch.library.register_autograd(
    "overlap_kernels::moe_combine", _moe_combine_backward, setup_context=_moe_combine_setup
)

_MOE_FIELDS = frozenset(f.name for f in dataclasses.fields(moe_ops.MoeConfig))


def _moe_knobs(config: moe_ops.MoeConfig | dict | None) -> dict:
    """The knobs of ``config`` that a dispatch and a combine read (the others tune the GEMM ops)."""
    if config is None:
        return {}
    if isinstance(config, moe_ops.MoeConfig):
        return {"max_recv_tokens": config.max_recv_tokens, "timeout_s": config.timeout_s}
    if not isinstance(config, dict) or not set(config) <= _MOE_FIELDS:
        raise OverlapInputError(
            f"moe_dispatch: config must be a MoeConfig or a dict of its fields "
            f"({', '.join(sorted(_MOE_FIELDS))}), got {config!r}"
        )
    return {k: config[k] for k in ("max_recv_tokens", "timeout_s") if k in config}


@dataclass(frozen=True, eq=False)  # (compared by identity: it holds tensors)
class MoeDispatchHandle:
    """:func:`moe_dispatch`'s handle: the dispatch op's tensors that
    :func:`moe_combine` takes back, and the routing its gradients dispatch with again."""

    expert_counts_tensor: torch.Tensor  # int64 [E_local], on the host: rows per local expert
    recv_weights: torch.Tensor  # fp32 [R]: each row's routing weight
    route: tuple[torch.Tensor, ...]  # the op's route_counts, row_in_block, token_rows, slot_of_row
    topk_ids: torch.Tensor  # [T, k]
    topk_weights: torch.Tensor  # [T, k], as passed: combine's weight gradient flows into it
    group_name: str
    timeout_s: float | None

    @property
    def expert_counts(self) -> tuple[int, ...]:
        """Rows of recv_x per local expert, as host ints (under
        torch.compile(fullgraph=True) unbacked ints; without fullgraph a graph break)."""
        return tuple(self.expert_counts_tensor.tolist())

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]


def moe_dispatch(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    group: dist.ProcessGroup | None = None,
    *,
    num_experts: int,
    config: moe_ops.MoeConfig | dict | None = None,
) -> tuple[torch.Tensor, MoeDispatchHandle]:
    """:func:`overlap_kernels.moe_dispatch` as the custom op, differentiable in x:
    (recv_x [R, H], handle). Run the experts on recv_x's rows
    (``handle.expert_counts`` per local expert), then :func:`moe_combine`.
    ``topk_weights`` get their gradient from the combine. Of ``config`` only
    ``max_recv_tokens`` and ``timeout_s`` touch a dispatch (None: the template's)."""
    knobs, name = _moe_knobs(config), name_of(group)
    # The op only carries the weights: moe_combine differentiates them.
    recv_x, recv_weights, counts, *route = _ops.moe_dispatch(
        x, topk_ids, topk_weights.detach(), name, num_experts, **knobs
    )
    handle = MoeDispatchHandle(counts, recv_weights, tuple(route), topk_ids, topk_weights, name,
                               knobs.get("timeout_s"))  # fmt: skip
    return recv_x, handle


def moe_combine(y: torch.Tensor, handle: MoeDispatchHandle) -> torch.Tensor:
    """:func:`overlap_kernels.moe_combine` as the custom op: out [T, N] = the sum
    over each token's slots of weight * y, differentiable in y and in the
    dispatch's topk_weights. ``handle``: :func:`moe_dispatch`'s (an op's plain
    MoeHandle only where nothing is differentiated: it runs the op eagerly)."""
    if isinstance(handle, MoeDispatchHandle):
        h = handle
        return _ops.moe_combine(y, h.recv_weights, h.topk_weights, h.topk_ids, *h.route, h.group_name,
                                timeout_s=h.timeout_s)  # fmt: skip
    if torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad:
        raise OverlapInputError(
            "moe_combine: y requires grad, and its backward dispatches the gradient again with the "
            "forward's routing, which a plain MoeHandle does not keep: dispatch with "
            "overlap_kernels.integrations.functional.moe_dispatch and pass its handle"
        )
    return moe_ops.moe_combine(y, handle)
