"""The forward of vLLM's RowParallelLinear with its GEMM and all-reduce fused.

:class:`GemmArRowParallel` is a mixin written against the attributes of
``vllm.model_executor.layers.linear.RowParallelLinear`` (0.32: ``weight``
[N, K_local], ``bias`` [N] or None, ``quant_method``, ``reduce_results``,
``tp_size``, ``input_is_parallel``, ``skip_bias_add``, ``return_bias``,
``prefix``) and imports nothing from vLLM, so that its logic is tested
against a stand-in class without vLLM installed (tests/test_integrations_vllm.py).
The concrete class (layer.py) names the unquantized method's type and the
tensor-parallel group.

Fused: ``out = all_reduce(x @ weight.t())`` by gemm_ar, then ``+ bias`` once
(vLLM's own forward adds the bias on rank 0 before the reduction instead), and
``(out, bias if skip_bias_add else None)`` or ``out`` as ``return_bias`` says.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

import overlap_kernels  # noqa: F401  (first: see integrations/__init__.py)

from .. import functional, torch_ops  # noqa: F401  (torch_ops: defines the op)

# Under vLLM's logger, whose handler and VLLM_LOGGING_LEVEL then show these
# lines beside vLLM's own; outside vLLM an ordinary logger.
logger = logging.getLogger("vllm.overlap_kernels")


@functools.cache
def note(kind: str, what: str) -> None:
    """One log line per layer kind and message, per process."""
    logger.info("overlap_kernels: %s %s", kind, what)


def layer_kind(prefix: str, fallback: str) -> str:
    """``model.layers.3.self_attn.o_proj`` -> ``self_attn.o_proj``: the prefix
    after its last layer index (the whole prefix where it has none)."""
    parts = prefix.split(".")
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    tail = parts[numbered[-1] + 1 :] if numbered else parts
    return ".".join(tail) or fallback


class GemmArRowParallel:
    """Mixin before a RowParallelLinear class: its forward runs gemm_ar where it can.

    The concrete class sets ``unquantized_method`` (the type of the quant method
    that keeps plain weights) and defines ``tp_device_group()``.
    """

    unquantized_method: type
    # Whether a forward traced by torch.compile runs gemm_ar too; False where the
    # plugin's compile pass takes the traced layers (it fuses vLLM's all-reduce
    # with the RMSNorm after it, which a gemm_ar in the graph would hide).
    fuse_compiled: bool = True

    def tp_device_group(self) -> dist.ProcessGroup:
        raise NotImplementedError

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.overlap_kind = layer_kind(self.prefix, type(self).__name__)
        self.overlap_group: dist.ProcessGroup | None = None
        self.overlap_group_name = ""
        self.overlap_blocker = self._static_blocker()
        if self.overlap_blocker is None:
            when = "" if self.fuse_compiled else " when eager (compiled: vLLM's, for the pass)"
            note(self.overlap_kind, f"runs gemm_ar (GEMM + all-reduce fused) on 2-D inputs{when}")
        else:
            note(self.overlap_kind, f"runs vLLM's own forward: {self.overlap_blocker}")

    def _static_blocker(self) -> str | None:
        """Why this layer never runs gemm_ar (None: it does, on suitable inputs).
        Decided once, from what the constructor fixed."""
        if not self.reduce_results:
            return "reduce_results=False (the caller reduces)"
        if self.tp_size <= 1:
            return f"tp_size={self.tp_size}: nothing to reduce"
        if type(self.quant_method) is not self.unquantized_method:
            return f"quantized weights ({type(self.quant_method).__name__})"
        if not self.input_is_parallel:
            return "input_is_parallel=False (the layer splits its input itself)"
        group = self.tp_device_group()
        if dist.get_world_size(group) != self.tp_size:
            return f"tp_size={self.tp_size} but the TP group has {dist.get_world_size(group)} ranks"
        self.overlap_group, self.overlap_group_name = group, group.group_name
        return None

    def _input_blocker(self, x: torch.Tensor) -> str | None:
        """Why this call cannot run gemm_ar (from shapes and dtypes only, as on every rank)."""
        if x.dim() != 2:
            return f"{x.dim()}-D input (gemm_ar takes [tokens, K_local])"
        w = self.weight
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            return f"weight {tuple(w.shape)} is not [N, {x.shape[1]}] (repacked after loading?)"
        if w.dtype != x.dtype:
            return f"input {x.dtype} and weight {w.dtype} differ"
        return None

    def _gemm_ar(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # (the group by name: a string is a plain constant in a traced graph)
            return torch.ops.overlap_kernels.gemm_ar(
                x.contiguous(), self.weight.t(), self.overlap_group_name
            )
        return functional.linear_ar(x, self.weight, None, self.overlap_group)

    def forward(
        self, input_: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if self.overlap_blocker is not None:  # (said once, by the constructor)
            return super().forward(input_)
        if not self.fuse_compiled and torch.compiler.is_compiling():
            return super().forward(input_)
        why = self._input_blocker(input_)
        if why is not None:
            if not torch.compiler.is_compiling():  # (a log call would break the graph)
                note(self.overlap_kind, f"runs vLLM's own forward on this call: {why}")
            return super().forward(input_)
        out = self._gemm_ar(input_)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias  # once, after the reduction
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)
