"""An Inductor post-grad pass that routes tensor-parallel collectives around
matmuls into our fused ops, in forward and backward graphs alike::

    mm(all_gather(x_shard, dim 0), w)        ->  ag_gemm(x_shard, w, return_gathered=True)
    reduce_scatter(mm(a, w), dim 0, sum|avg)  ->  gemm_rs(a, w)
    all_reduce(mm(a, w), sum)                 ->  gemm_ar(a, w)
    rmsnorm(all_reduce(mm(a, w), sum) + residual) * weight
                                              ->  gemm_ar_rmsnorm(a, w, residual, weight, eps)
    rmsnorm(all_reduce(p, sum) + residual) * weight  ->  all_reduce_rmsnorm(p, residual, weight, eps)

the collectives as ``torch.distributed._functional_collectives`` writes them
(what DTensor and torch's own TP styles emit). ``enable()`` appends the pass
to ``torch._inductor.config.post_grad_custom_post_pass``; an unmodified model
compiled afterwards runs our ops. The op picks its path at run time, so the
pass rewrites without a shape gate.

The RMSNorm is matched as ``F.rms_norm`` and the hand-written form (Llama's:
statistics of ``r.float()``, cast back, times the weight) decompose in the
post-grad graph, over the last dim of a 2-D tensor; the fused op returns the
normed rows and the new residual (the add's result), which the add's other
users take. A sum used elsewhere too (saved for backward) keeps the unfused
ops: the fused op returns the sum only with the residual in it. One rewrite,
:func:`fuse_reduction_point`, serves this pass and the vLLM plugin's, which
finds the same points in vLLM's own ops (integrations/vllm/fused_norm.py).

The all-reduce is what torch's ``RowwiseParallel`` with a ``Replicate()``
output emits in forward, and ``ColwiseParallel`` with a replicated input in
backward (its input gradient, a partial sum, made whole).

What it leaves alone: gathers along another dim, reduce-scatters and
all-reduces of anything but a 2-D matmul's only use (an ``addmm``, a linear
with its bias, included), all-reduces but sums, matmuls whose A is not the
gathered tensor itself (reshaped 3-D activations), and operands the kernels
cannot read as they stand in the graph (A not row-major, B neither row-major
nor a row-major matrix transposed): those keep torch's collectives.

The pattern finders of the gather and the reduce-scatter are torch's own
(``fx_passes/micro_pipeline_tp.py``, private to torch: a torch that moves them
makes :func:`enable` raise); the all-reduce's is here, matching funcol's
``wait_tensor(all_reduce(...))`` as torch's reduce-scatter finder does.
"""

from __future__ import annotations

import operator
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.fx_passes import micro_pipeline_tp as tp
from torch._inductor.pattern_matcher import stable_topological_sort

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from ..ops.checks import SUPPORTED_DTYPES, is_row_major, weight_layout_ok
from . import autograd  # noqa: F401  (the ops' gradients: graphs are traced with them)

_ops = torch.ops.overlap_kernels
_c10d = torch.ops._c10d_functional
_mm = torch.ops.aten.mm.default


def _readable(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether the kernels take ``a @ b`` as the graph holds a and b: dtypes the
    ops serve, and layouts they read. The op is tagged ``needs_fixed_stride_order``,
    so Inductor hands it its inputs in the stride order of their traced values
    (a transposed view stays transposed, and a transposed A would be refused at
    run time)."""
    a_val, b_val = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(a_val, torch.Tensor) and isinstance(b_val, torch.Tensor)):
        return False
    served = a_val.dtype in SUPPORTED_DTYPES and b_val.dtype == a_val.dtype
    return (
        served
        and a_val.dim() == b_val.dim() == 2
        and is_row_major(a_val)
        and weight_layout_ok(b_val)
    )


def _route_all_gathers(graph: torch.fx.Graph) -> int:
    routed = 0
    for ag in tp.find_all_gather_patterns(graph):
        if ag.gather_dim != 0:
            continue
        # (torch's finder also returns mms that take the gathered x as B: a wgrad's)
        matmuls = [m for m in tp._find_consumer_matmuls(ag.res_node)
                   if len(m.nodes) == 1 and m.nodes[0].target is _mm and m.A_node is ag.res_node
                   and ag.res_node not in m.arg_ancestor_nodes]  # fmt: skip
        if len(matmuls) != 1:  # one ag_gemm per gather; several consumers keep the gather
            continue
        (matmul,) = matmuls
        if not _readable(ag.shard_node, matmul.B_node):
            continue
        with graph.inserting_before(matmul.nodes[0]):
            fused = graph.call_function(_ops.ag_gemm.default, (ag.shard_node, matmul.B_node, ag.group_name),
                                        {"return_gathered": True})  # fmt: skip
            out = graph.call_function(operator.getitem, (fused, 0))
            gathered = graph.call_function(operator.getitem, (fused, 1))
        matmul.replace_with(out)
        matmul.erase()
        ag.replace_with(
            gathered
        )  # other users of the gathered x take ours (a model saving it for wgrad)
        ag.erase()
        routed += 1
    return routed


def _route_reduce_scatters(graph: torch.fx.Graph) -> int:
    routed = 0
    for rs in tp.find_reduce_scatter_patterns(graph):
        if (
            rs.scatter_dim != 0
            or rs.reduce_op not in ("sum", "avg")
            or len(rs.input_node.users) != 1
        ):
            continue
        matmul = tp._find_producer_matmul(rs.input_node)
        if matmul is None or len(matmul.nodes) != 1 or matmul.nodes[0].target is not _mm:
            continue
        if rs.wait_tensor_node in matmul.arg_ancestor_nodes or not _readable(
            matmul.A_node, matmul.B_node
        ):
            continue
        with graph.inserting_before(rs.reduce_scatter_node):
            fused = graph.call_function(
                _ops.gemm_rs.default, (matmul.A_node, matmul.B_node, rs.group_name, rs.reduce_op)
            )
        rs.replace_with(fused)
        rs.erase()
        matmul.erase()
        routed += 1
    return routed


def _all_reduces(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(all_reduce, wait_tensor) of every funcol ``wait_tensor(all_reduce(t, op, group))``
    whose all-reduce has no other user than its wait and, at most, the graph's
    output (its result saved for backward: torch's reduce-scatter finder allows the same)."""
    found = []
    for wait in graph.find_nodes(op="call_function", target=_c10d.wait_tensor.default):
        ar = wait.args[0]
        if (
            isinstance(ar, torch.fx.Node)
            and ar.target is _c10d.all_reduce.default
            and all(user is wait or user.op == "output" for user in ar.users)
        ):
            found.append((ar, wait))
    return found


def _arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs[name]


def _route_all_reduces(graph: torch.fx.Graph) -> int:
    routed = 0
    for ar, wait in _all_reduces(graph):
        source, reduce_op = _arg(ar, 0, "input"), _arg(ar, 1, "reduce_op")
        if reduce_op != "sum" or len(source.users) != 1 or source.target is not _mm:
            continue  # (the mm's only user: another would need the partial product)
        a, b = source.args
        if not _readable(a, b):
            continue
        with graph.inserting_before(ar):
            fused = graph.call_function(_ops.gemm_ar.default, (a, b, _arg(ar, 2, "group_name")))
        wait.replace_all_uses_with(fused)
        for user in list(ar.users):
            if user.op == "output":  # saved for backward: save ours instead
                user.replace_input_with(ar, fused)
        for node in (wait, ar, source):
            graph.erase_node(node)
        routed += 1
    return routed


_aten = torch.ops.aten
_cast = torch.ops.prims.convert_element_type.default


def _only_user(node: torch.fx.Node, *targets) -> torch.fx.Node | None:
    """``node``'s one user, where it is a call of one of ``targets``."""
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target in targets else None


def _dtype(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class _Norm(NamedTuple):
    """An RMSNorm of one tensor found in a post-grad graph."""

    normed: torch.fx.Node  # its result
    weight: torch.fx.Node
    eps: float
    nodes: list[torch.fx.Node]  # every node of it, in graph order


def _rmsnorm_of(r: torch.fx.Node, dtype: torch.dtype | None = None) -> _Norm | None:
    """``rmsnorm(r) * weight`` as the post-grad graph writes ``F.rms_norm(r, [N],
    weight, eps)`` or its hand-written form (``r.float()``, ``pow(2).mean(-1,
    keepdim=True)``, ``+ eps``, ``rsqrt``, times r, cast back, times the weight,
    in either order of the last two), over the last dim of a 2-D r, its result
    in ``dtype`` (default: r's; r may be an fp32 sum whose norm is cast back to
    the model's dtype, as vLLM's native fused_add_rms_norm writes it); None elsewhere."""
    val = r.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    casts = [u for u in r.users if u.target is _cast and u.args[1] == torch.float32]
    sources = {r, *casts}
    for square in (u for src in sources for u in src.users):
        if square.target is not _aten.pow.Tensor_Scalar or square.args[1] != 2:
            continue
        mean = _only_user(square, _aten.mean.dim)
        if mean is None or list(mean.args[1]) not in ([-1], [1]) or not _arg(mean, 2, "keepdim"):
            continue
        add_eps = _only_user(mean, _aten.add.Scalar, _aten.add.Tensor)
        if add_eps is None or not isinstance(add_eps.args[1], float):
            continue
        rsqrt = _only_user(add_eps, _aten.rsqrt.default)
        scaled = rsqrt and _only_user(rsqrt, _aten.mul.Tensor)
        if scaled is None or not ({*scaled.args} - {rsqrt}) <= sources:
            continue
        nodes = [square, mean, add_eps, rsqrt, scaled]
        step = _only_user(scaled, _cast, _aten.mul.Tensor)
        normed = weight = None
        if step is not None and step.target is _cast:  # cast back, then times the weight
            weighted = _only_user(step, _aten.mul.Tensor)
            if weighted is not None:
                weight, normed = next(iter({*weighted.args} - {step}), None), weighted
                nodes += [step, weighted]
        elif step is not None:  # times the weight (in fp32), then cast back where r is not
            weight, normed = next(iter({*step.args} - {scaled}), None), step
            nodes.append(step)
            back = _only_user(step, _cast)
            if back is not None:
                normed = back
                nodes.append(back)
        if normed is None or _dtype(normed) != (dtype or val.dtype):
            return None
        if not isinstance(weight, torch.fx.Node):
            return None
        weight_val = weight.meta.get("val")
        if not isinstance(weight_val, torch.Tensor) or tuple(weight_val.shape) != (val.shape[1],):
            return None
        used = [c for c in casts if all(u in nodes for u in c.users)]
        return _Norm(normed, weight, add_eps.args[1], used + nodes)
    return None


class ReductionPoint(NamedTuple):
    """A decoder layer's reduction point found in a post-grad graph: a sum
    all-reduce, the residual added to it, an RMSNorm of that. Finders build it
    for each form a graph may hold it in (torch's functional collectives here,
    vLLM's ops in integrations/vllm/fused_norm.py); :func:`fuse_reduction_point`
    rewrites every form the same way."""

    partial: torch.fx.Node  # [M, N]: this rank's addend of the sum
    group_name: str  # the torch ProcessGroup the sum runs over
    residual: torch.fx.Node | None  # [M, N], added to the sum (None: nothing is)
    norm_weight: torch.fx.Node  # [N]
    eps: float
    normed: torch.fx.Node  # the normed rows: its users take the fused op's first output
    summed: torch.fx.Node | None  # residual + sum: its users take the second (None: unused)
    nodes: tuple[torch.fx.Node, ...]  # what the fused op replaces, normed and summed among them


def fuse_reduction_point(graph: torch.fx.Graph, point: ReductionPoint) -> bool:
    """Rewrite ``point`` to ``gemm_ar_rmsnorm(a, b, ...)`` where its partial is
    ``mm(a, b)`` with no other use and operands the kernels read and a residual
    is added, else to
    ``all_reduce_rmsnorm(partial, ...)``. False (the graph unchanged) where the
    ops cannot take it as the graph holds it: dtypes or layouts they do not
    serve, a norm weight of another dtype (the op rounds in x's), or a node
    of the point used outside it (other than the normed rows and the new residual).
    The fused op's inputs may stand after the nodes it replaces: the caller
    sorts the graph (``stable_topological_sort``) once it has rewritten."""
    summed_val, weight_val = point.partial.meta.get("val"), point.norm_weight.meta.get("val")
    if not (isinstance(summed_val, torch.Tensor) and isinstance(weight_val, torch.Tensor)):
        return False
    dtype = summed_val.dtype
    if (
        summed_val.dim() != 2
        or dtype not in SUPPORTED_DTYPES
        or not is_row_major(summed_val)
        or weight_val.dtype != dtype
        or tuple(weight_val.shape) != (summed_val.shape[1],)
        or not isinstance(point.eps, float)
        or point.eps <= 0
        or any(_dtype(n) != dtype for n in (point.normed, point.summed) if n is not None)
    ):
        return False
    if point.residual is not None:
        residual_val = point.residual.meta.get("val")
        if (
            not isinstance(residual_val, torch.Tensor)
            or residual_val.dtype != dtype
            or residual_val.shape != summed_val.shape
            or residual_val.stride(1) != 1
        ):
            return False
    replaced = set(point.nodes)
    for node in point.nodes:  # (normed's and summed's users are rerouted below)
        if node not in (point.normed, point.summed) and not set(node.users) <= replaced:
            return False
    source, group = point.partial, point.group_name
    fuse_gemm = source.target is _mm and len(source.users) == 1 and _readable(*source.args)
    tail = (point.residual, point.norm_weight, point.eps, group)
    with graph.inserting_before(point.normed):  # (every input of the point stands before it)
        if fuse_gemm:
            fused = graph.call_function(_ops.gemm_ar_rmsnorm.default, (*source.args, *tail))
        else:
            fused = graph.call_function(_ops.all_reduce_rmsnorm.default, (source, *tail))
        normed = graph.call_function(operator.getitem, (fused, 0))
        residual_out = graph.call_function(operator.getitem, (fused, 1))
    point.normed.replace_all_uses_with(normed)
    if point.summed is not None:
        point.summed.replace_all_uses_with(residual_out)
    pending = [*point.nodes, *([source] if fuse_gemm else [])]
    while pending:  # users first: every node here is dead once its users are gone
        dead = [node for node in pending if not node.users]
        for node in dead:
            graph.erase_node(node)
            pending.remove(node)
        if not dead:
            raise RuntimeError(f"overlap_kernels: nodes still in use after the rewrite: {pending}")
    return True


def reduction_point_after(
    summed: torch.fx.Node, partial: torch.fx.Node, group_name: str, collective: list[torch.fx.Node]
) -> ReductionPoint | None:
    """The point where ``summed`` (the all-reduce's result, held by the
    ``collective`` nodes) has a residual added and is normed: ``rmsnorm(summed
    + residual) * weight`` (:func:`_rmsnorm_of`), the add in summed's dtype, or
    in fp32 of both up-cast with the new residual cast back (vLLM's native
    fused_add_rms_norm in bf16/fp16); None where no such add and norm follow."""
    dtype = _dtype(summed)
    add = _only_user(summed, _aten.add.Tensor)
    up = None
    if add is None and dtype != torch.float32:
        up = _only_user(summed, _cast)
        add = up and up.args[1] == torch.float32 and _only_user(up, _aten.add.Tensor)
    if not add or add.kwargs or len(add.args) != 2:
        return None
    own = up or summed
    residual = next(iter(a for a in add.args if a is not own), None)
    if not isinstance(residual, torch.fx.Node):
        return None
    nodes, residual_out = [add], add
    if up is not None:  # fp32: the residual up-cast beside the sum, the new residual cast back
        if residual.target is not _cast or _dtype(residual.args[0]) != dtype:
            return None
        backs = [u for u in add.users if u.target is _cast and u.args[1] == dtype]
        if len(backs) != 1:
            return None
        nodes += [up, backs[0], *([residual] if len(residual.users) == 1 else [])]
        residual, residual_out = residual.args[0], backs[0]
    norm = _rmsnorm_of(add, dtype)
    if norm is None:
        return None
    return ReductionPoint(partial, group_name, residual, norm.weight, norm.eps, norm.normed,
                          residual_out, (*collective, *nodes, *norm.nodes))  # fmt: skip


def _funcol_reduction_points(graph: torch.fx.Graph):
    """Every ``rmsnorm(all_reduce(p) + residual) * weight`` (funcol, sum), each
    found once the one before it is rewritten (a rewrite replaces the add that
    the next point takes as its residual)."""
    for ar, wait in _all_reduces(graph):
        waits = [wait]  # (a funcol wait may be waited on again: each is a no-op on its result)
        while _only_user(waits[-1], _c10d.wait_tensor.default) is not None:
            waits.append(_only_user(waits[-1], _c10d.wait_tensor.default))
        if _arg(ar, 1, "reduce_op") != "sum":
            continue
        point = reduction_point_after(
            waits[-1], _arg(ar, 0, "input"), _arg(ar, 2, "group_name"), [ar, *waits]
        )
        if point is not None:
            yield point


def _route_all_reduce_norms(graph: torch.fx.Graph) -> int:
    """``rmsnorm(all_reduce(p) + residual) * weight`` (sum) -> all_reduce_rmsnorm, and
    with p = mm(a, b) (its only use) -> gemm_ar_rmsnorm: the op returns the normed
    rows and the new residual, which the add's other users take."""
    return sum(fuse_reduction_point(graph, p) for p in _funcol_reduction_points(graph))


class Routed(NamedTuple):
    """What the pass routed in one graph."""

    all_gathers: int  # to ag_gemm
    reduce_scatters: int  # to gemm_rs
    all_reduces: int  # to gemm_ar


class RouteTPToOverlapKernels(CustomGraphPass):
    """The pass; ``routed`` holds, per graph it ran on, the :class:`Routed` counts
    (its all-reduces those with a norm after them too), and ``normed`` how many
    all-reduces went to an op with the residual add and RMSNorm fused after it."""

    def __init__(self):
        self.routed: list[Routed] = []
        self.normed: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        normed = _route_all_reduce_norms(graph)  # (first: gemm_ar would take their matmuls)
        counts = Routed(
            _route_all_gathers(graph),
            _route_reduce_scatters(graph),
            normed + _route_all_reduces(graph),
        )
        self.normed.append(normed)
        if any(counts):
            stable_topological_sort(
                graph
            )  # the fused ops' inputs may stand after the collective they replace
            graph.eliminate_dead_code()
        self.routed.append(counts)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


class _Chained(CustomGraphPass):
    """Passes run one after another, as one: for torch versions whose Inductor
    takes a single post-grad custom pass, not a list (torch 2.11)."""

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for each in self.passes:
            each(graph)

    def uuid(self) -> bytes | None:
        """None (no caching) where a pass has none, as Inductor reads a single pass's."""
        uuids = [each.uuid() for each in self.passes]
        return None if any(u is None for u in uuids) else repr(uuids).encode()


def _takes_lists() -> bool:
    """Whether this torch's Inductor takes a list of post-grad custom passes."""
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes  # noqa: F401
    except ImportError:
        return False
    return True


def add_post_grad_pass(
    new: CustomGraphPass, config: ModuleType | SimpleNamespace | None = None
) -> None:
    """Append ``new`` to Inductor's post-grad custom passes (``config``:
    ``torch._inductor.config`` by default), keeping any pass already there:
    in a list where this torch's Inductor takes one, else chained into one."""
    if config is None:
        from torch._inductor import config
    before = config.post_grad_custom_post_pass
    if before is None:
        config.post_grad_custom_post_pass = new
        return
    passes = [*(before if isinstance(before, (list, tuple)) else [before]), new]
    config.post_grad_custom_post_pass = passes if _takes_lists() else _Chained(passes)


def enable(config: ModuleType | SimpleNamespace | None = None) -> RouteTPToOverlapKernels:
    """Append the pass to Inductor's post-grad custom passes (:func:`add_post_grad_pass`).
    Returns the pass (its ``routed`` says what it did)."""
    route = RouteTPToOverlapKernels()
    add_post_grad_pass(route, config)
    return route
