"""An Inductor post-grad pass that routes tensor-parallel collectives around
matmuls into our fused ops, in forward and backward graphs alike::

    mm(all_gather(x_shard, dim 0), w)        ->  ag_gemm(x_shard, w, return_gathered=True)
    reduce_scatter(mm(a, w), dim 0, sum|avg)  ->  gemm_rs(a, w)

the collectives as ``torch.distributed._functional_collectives`` writes them
(what DTensor and torch's own TP styles emit). ``enable()`` appends the pass
to ``torch._inductor.config.post_grad_custom_post_pass``; an unmodified model
compiled afterwards runs our ops. The op picks its path at run time, so the
pass rewrites without a shape gate.

What it leaves alone: gathers along another dim, reduce-scatters of anything
but a 2-D matmul's only use, and matmuls whose A is not the gathered tensor
itself (reshaped 3-D activations): those keep torch's collectives.

The pattern finders are torch's own (``fx_passes/micro_pipeline_tp.py``,
private to torch: a torch that moves them makes :func:`enable` raise).
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.fx_passes import micro_pipeline_tp as tp
from torch._inductor.pattern_matcher import stable_topological_sort

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from . import autograd  # noqa: F401  (the ops' gradients: graphs are traced with them)

_ops = torch.ops.overlap_kernels
_mm = torch.ops.aten.mm.default


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
        if rs.wait_tensor_node in matmul.arg_ancestor_nodes:
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


class RouteTPToOverlapKernels(CustomGraphPass):
    """The pass; ``routed`` counts, per graph it ran on, (all-gathers, reduce-scatters) routed."""

    def __init__(self):
        self.routed: list[tuple[int, int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        counts = (_route_all_gathers(graph), _route_reduce_scatters(graph))
        if any(counts):
            stable_topological_sort(
                graph
            )  # the fused ops' inputs may stand after the collective they replace
            graph.eliminate_dead_code()
        self.routed.append(counts)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def enable(config=None) -> RouteTPToOverlapKernels:
    """Append the pass to Inductor's post-grad custom passes (``config``:
    ``torch._inductor.config`` by default), keeping any pass already there.
    Returns the pass (its ``routed`` says what it did)."""
    if config is None:
        from torch._inductor import config
    route = RouteTPToOverlapKernels()
    before = config.post_grad_custom_post_pass
    if before is None:
        config.post_grad_custom_post_pass = route
    else:
        config.post_grad_custom_post_pass = [
            *(before if isinstance(before, (list, tuple)) else [before]),
            route,
        ]
    return route
