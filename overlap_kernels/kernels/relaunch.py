"""Launching a compiled kernel again without Triton's per-call work.

At decode sizes a fused op's host time is its time: a cached plan passes the
same ~35 arguments call after call except a few pointers and the epoch, yet
every ``kernel[grid](...)`` binds and specialises all of them and looks the
compiled kernel up again. :func:`launch` makes the first launch the normal
way and returns a :class:`Relaunch` that keeps the compiled kernel and the
bound arguments; calling it launches the same kernel with only the named
arguments replaced.

What a relaunch may change: tensors whose address is 16-byte aligned (the
compiled kernel may assume that of every pointer argument), and arguments the
kernel does not specialise on (``do_not_specialize``, floats). Anything else
is a different plan and gets a launch of its own. On Triton's interpreter, or
with a launch hook installed (a profiler), there is no relaunch: ``launch``
returns None and callers launch the normal way each time.

A relaunch calls the launcher's C entry itself and, where its caller keeps
one (``Workspace.launch_scratch``), gives it the scratch of a kernel's
device-side TMA descriptors: an allocation per launch costs host time that
a decode-size call cannot hide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
from triton import knobs
from triton.runtime import _allocation
from triton.runtime.driver import driver

from ..runtime.platform import INTERPRETER

if TYPE_CHECKING:
    from triton.runtime.jit import KernelInterface

POINTER_ALIGN = 16  # bytes: Triton compiles a variant per pointer argument aligned so or not


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (Triton keeps a chain, empty when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _descriptor_scratch(size: int, align: int, stream) -> torch.Tensor:
    # A fresh buffer per launch, freed as the launch returns: a buffer kept
    # between launches would outlive a torch.compile CUDA-graph warm-up whose
    # memory pool it came from, which torch refuses.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from an allocator.
    Triton keeps its allocator per thread (a context variable), and autograd
    runs backward on threads of its own: set it wherever none is set (one a
    caller set stays)."""
    allocator = getattr(_allocation, "_allocator", None)
    if allocator is None or allocator.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(_descriptor_scratch)  # (a Triton without them: set every time)


# What a relaunch reads from Triton's launcher (compiled.run) to call its C entry itself.
_LAUNCHER_FIELDS = ("launch", "num_ctas", "global_scratch_size", "global_scratch_align",
                    "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")  # fmt: skip


class Relaunch:
    """One compiled kernel, its grid and its bound arguments, launched again."""

    def __init__(
        self,
        jit_fn,
        compiled,
        grid: tuple[int, ...],
        args: tuple,
        kwargs: dict,
        device: torch.device,
    ):
        binder = jit_fn.device_caches[device.index][4]
        bound, _, _ = binder(*args, **kwargs)
        self._names = {name: i for i, name in enumerate(bound)}
        # Addresses, not tensors: the launcher takes either, and a kept tensor
        # (the first call's input or output) would never be freed. The tensors
        # that stay (tile tables, the workspace's) live as long as their plan.
        self._values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound.values()]
        self._compiled = compiled
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self.device_index = device.index
        self._current_stream = driver.active.get_current_stream  # (a raw handle, no Stream object)
        launcher = compiled.run
        # The launcher's C entry and what Triton passes it ahead of the arguments
        # (Triton 3.6's launcher). None, so Triton's own path, where a profiler's
        # scratch is needed too, or where this Triton's launcher differs.
        self._entry = None
        if (
            all(hasattr(launcher, name) for name in _LAUNCHER_FIELDS)
            and not launcher.profile_scratch_size
        ):
            self._entry = launcher.launch
            programs = self._grid[0] * self._grid[1] * self._grid[2]
            self._scratch_bytes = programs * launcher.num_ctas * launcher.global_scratch_size
            self._scratch_align = max(1, launcher.global_scratch_align)
            self._flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
            # With programmatic dependent launch the next kernel on the stream may start
            # before this one ends: they must not share a scratch slot.
            self._keeps_scratch = bool(self._scratch_bytes) and not launcher.launch_pdl

    def __call__(self, scratch=None, stream=None, /, **changed) -> bool:
        """Launch with ``changed`` arguments replaced, on the current stream (``stream``:
        its raw handle, where the caller has it); False (nothing launched) when a tensor
        is not 16-byte aligned or a launch hook is set. ``scratch(stream, nbytes)``,
        where given, says where this launch may keep Triton's scratch (an address, or
        None: a fresh buffer as Triton makes)."""
        runtime = knobs.runtime
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return False
        values, names = self._values, self._names
        for name, value in changed.items():
            if isinstance(value, torch.Tensor):
                value = value.data_ptr()
                if value % POINTER_ALIGN:
                    return False
            values[names[name]] = value
        kernel = self._compiled
        if stream is None:
            stream = self._current_stream(self.device_index)
        address = None
        if self._entry is not None and self._keeps_scratch and scratch is not None:
            address = scratch(stream, self._scratch_bytes)
            if address is not None and address % self._scratch_align:
                address = None
        if self._entry is None or (self._scratch_bytes and address is None):
            ensure_descriptor_allocator()  # (this thread's: autograd's may have none yet)
            kernel.run(*self._grid, stream, kernel.function, kernel.packed_metadata, None, None,
                       None, *values)  # fmt: skip
            return True
        self._entry(*self._grid, stream, kernel.function, *self._flags, address, None,
                    kernel.packed_metadata, None, None, None, *values)  # fmt: skip
        return True


def launch(
    jit_fn: KernelInterface, grid: tuple[int, ...], args: tuple, kwargs: dict, device: torch.device
) -> Relaunch | None:
    """``jit_fn[grid](*args, **kwargs)``, and a :class:`Relaunch` of it (None on the interpreter)."""
    compiled = jit_fn[grid](*args, **kwargs)
    if INTERPRETER or device.type != "cuda" or compiled is None:
        return None
    return Relaunch(jit_fn, compiled, grid, args, kwargs, device)
