"""Where the kernels run: compiled on CUDA GPUs, or in Triton's interpreter on the CPU.

Imported before any kernel module is decorated, because Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` runs. Without a CUDA device the
library turns the interpreter on by itself, so the same kernels run on CPU
tensors (multi-rank tests use one process per rank and shared-memory files).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

HAS_CUDA: bool = torch.cuda.is_available()

if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ and "triton" in sys.modules:
    raise ImportError(
        "overlap_kernels: triton was imported before overlap_kernels on a machine without a "
        "CUDA GPU, so Triton built its own functions for compiling, not for its CPU "
        "interpreter. Import overlap_kernels first, or set TRITON_INTERPRET=1 in the environment."
    )

if not HAS_CUDA:
    # setdefault: an explicit TRITON_INTERPRET=0 is kept, so that the sm_90
    # compile check (tests/test_compile_sm90.py) can build the real kernels on
    # a machine with no GPU. Nothing can be launched that way.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The one place that picks the signal implementation (see runtime/signals.py):
# inline PTX (tight acquire spin, %globaltimer deadline) when compiled for CUDA,
# plain Triton atomics and a host clock word in the interpreter, which has no asm.
FAST_SIGNALS: bool = HAS_CUDA and not INTERPRETER


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors a persistent grid is sized from (interpreter: a small fixed count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter runs programs one after another; a few programs exercise
    # the persistent loop without making CPU tests slower.
    return 4


def to_device(
    values: np.ndarray | Sequence[int], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Small host values (a numpy array or a list) on ``device``, without a stream sync.

    A blocking copy waits for the stream, so the host waits for the device
    (at decode sizes host time is a call's time); a copy through
    ``pin_memory()`` holds the host in cudaMemcpyAsync until the device is
    ready for it, behind a kernel that waits for peers as long as that wait
    (docs/design.md, "MoE host-to-device copies"). A non-blocking copy of a
    few KiB of pageable memory returns once the driver has staged it, so
    callers keep tables small: per-row tables are expanded on the device from
    per-run values (kernels/runs.py)."""
    host = torch.as_tensor(values, dtype=dtype)
    return host if device.type != "cuda" else host.to(device, non_blocking=True)


@contextlib.contextmanager
def cublas_leaves_sms(count: int) -> Iterator[None]:
    """cuBLAS matmuls launched inside target every SM but ``count`` (PyTorch's
    experimental SM carve-out; nothing where this PyTorch lacks it). cuBLAS's
    kernels hold every SM until they end, so a one-program kernel of ours on
    another stream (a flag wait that gates a copy) would otherwise start only
    as a matmul drains."""
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    set_ = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if get is None or set_ is None or count <= 0:
        yield
        return
    before = get()
    set_(count)
    try:
        yield
    finally:
        set_(before)
