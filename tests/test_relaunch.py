"""kernels/relaunch.py: a relaunch passes the bound arguments with only the named ones
replaced, and declines (so the caller launches the normal way) where it may not.

A relaunch needs a compiled kernel, so on CPU the kernel and Triton's binder are
stand-ins that record what the launcher receives; the GPU tests of gemm_rs and
gemm_ar run the real one on every call after their first.
"""

from __future__ import annotations

import pytest
import torch

from overlap_kernels.kernels import relaunch as relaunch_module
from overlap_kernels.kernels.relaunch import Relaunch

knobs = relaunch_module.knobs  # Triton's, imported after overlap_kernels has picked the interpreter


class _Compiled:
    """Records the launcher's arguments as Triton's compiled kernel receives them."""

    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _JitFunction:
    """Triton's binder for ``kernel(a_ptr, n, epoch, BLOCK: constexpr)``."""

    def __init__(self):
        def binder(a_ptr, n, epoch, BLOCK=None, **options):
            return {"a_ptr": a_ptr, "n": n, "epoch": epoch, "BLOCK": BLOCK}, None, options

        self.device_caches = {0: (None, None, None, None, binder)}


@pytest.fixture
def relaunch(monkeypatch):
    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                return f"stream-{device}"

    monkeypatch.setattr(relaunch_module, "driver", _Driver)
    first = torch.zeros(64, dtype=torch.uint8)
    compiled = _Compiled()
    again = Relaunch(_JitFunction(), compiled, (3,), (first, 7, 1), {"BLOCK": 32, "num_warps": 4},
                     torch.device("cuda", 0))  # fmt: skip
    return again, compiled, first


def test_relaunch_replaces_only_the_named_arguments(relaunch):
    again, compiled, first = relaunch
    other = torch.zeros(64, dtype=torch.uint8)
    assert again(a_ptr=other, epoch=2)
    grid_and_launch = (3, 1, 1, "stream-0", "fn-handle", "packed", None, None, None)
    # Tensors travel as addresses (a kept tensor would never be freed); constexprs stay in place.
    assert compiled.calls == [grid_and_launch + (other.data_ptr(), 7, 2, 32)]
    assert again(epoch=3)
    assert compiled.calls[-1] == grid_and_launch + (other.data_ptr(), 7, 3, 32)
    assert first.data_ptr() != other.data_ptr()


def test_relaunch_declines_a_misaligned_tensor(relaunch):
    again, compiled, first = relaunch
    offset = first[1:]  # one byte past a 16-byte boundary
    assert not again(a_ptr=offset, epoch=2)
    assert compiled.calls == []


def test_relaunch_declines_while_a_launch_hook_is_installed(relaunch):
    again, compiled, _ = relaunch

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not again(epoch=2)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert compiled.calls == []
    assert again(epoch=2)


def test_no_relaunch_in_the_interpreter():
    calls = []

    class _Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "compiled"

    assert (
        relaunch_module.launch(_Kernel(), (2,), (1, 2), {"BLOCK": 4}, torch.device("cpu")) is None
    )
    assert calls == [((2,), (1, 2), {"BLOCK": 4})]
