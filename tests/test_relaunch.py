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


class _Launcher:
    """Triton's launcher as a relaunch reaches it: its C entry (``launch``), and
    the launcher itself (Triton's own path, which makes the scratch)."""

    num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False

    def __init__(self, scratch_size: int, profile_scratch_size: int = 0):
        self.global_scratch_size, self.global_scratch_align = scratch_size, 128
        self.profile_scratch_size = profile_scratch_size
        self.entry_calls, self.triton_calls = [], []

    def launch(self, *args):
        self.entry_calls.append(args)

    def __call__(self, *args):
        self.triton_calls.append(args)


class _Compiled:
    """What a relaunch reads from Triton's compiled kernel."""

    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self, launcher: _Launcher):
        self.run = launcher


class _JitFunction:
    """Triton's binder for ``kernel(a_ptr, n, epoch, BLOCK: constexpr)``."""

    def __init__(self):
        def binder(a_ptr, n, epoch, BLOCK=None, **options):
            return {"a_ptr": a_ptr, "n": n, "epoch": epoch, "BLOCK": BLOCK}, None, options

        self.device_caches = {0: (None, None, None, None, binder)}


def _relaunch(monkeypatch, scratch_size: int = 0, profile_scratch_size: int = 0):
    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                return f"stream-{device}"

    monkeypatch.setattr(relaunch_module, "driver", _Driver)
    first = torch.zeros(64, dtype=torch.uint8)
    launcher = _Launcher(scratch_size, profile_scratch_size)
    again = Relaunch(_JitFunction(), _Compiled(launcher), (3,), (first, 7, 1),
                     {"BLOCK": 32, "num_warps": 4}, torch.device("cuda", 0))  # fmt: skip
    return again, launcher, first


@pytest.fixture
def relaunch(monkeypatch):
    return _relaunch(monkeypatch)


# What the C entry takes ahead of the kernel's arguments: grid, stream, function,
# cooperative and PDL flags, global and profile scratch, metadata, launch
# metadata and the two hooks.
_ENTRY = (3, 1, 1, "stream-0", "fn-handle", False, False)
_AFTER_SCRATCH = (None, "packed", None, None, None)


def test_relaunch_replaces_only_the_named_arguments(relaunch):
    again, launcher, first = relaunch
    other = torch.zeros(64, dtype=torch.uint8)
    assert again(a_ptr=other, epoch=2)
    # Tensors travel as addresses (a kept tensor would never be freed); constexprs stay in place.
    assert launcher.entry_calls == [
        _ENTRY + (None,) + _AFTER_SCRATCH + (other.data_ptr(), 7, 2, 32)
    ]
    assert again(epoch=3)
    assert launcher.entry_calls[-1] == _ENTRY + (None,) + _AFTER_SCRATCH + (
        other.data_ptr(),
        7,
        3,
        32,
    )
    assert first.data_ptr() != other.data_ptr() and launcher.triton_calls == []


def test_relaunch_keeps_its_scratch_where_the_caller_has_a_slot(monkeypatch):
    again, launcher, first = _relaunch(monkeypatch, scratch_size=256)
    asked = []

    def slot(stream, nbytes):
        asked.append((stream, nbytes))
        return 1 << 20

    assert again(slot, epoch=2)
    assert asked == [("stream-0", 3 * 256)]  # a program's scratch times the grid
    assert launcher.entry_calls == [
        _ENTRY + (1 << 20,) + _AFTER_SCRATCH + (first.data_ptr(), 7, 2, 32)
    ]


@pytest.mark.parametrize("why", ["no provider", "no slot", "misaligned slot", "profiler scratch"])
def test_relaunch_leaves_the_scratch_to_triton_otherwise(monkeypatch, why):
    again, launcher, first = _relaunch(
        monkeypatch, scratch_size=256, profile_scratch_size=64 if why == "profiler scratch" else 0
    )
    slot = {
        "no provider": None,
        "no slot": lambda stream, nbytes: None,
        "misaligned slot": lambda stream, nbytes: (1 << 20) + 16,
        "profiler scratch": lambda stream, nbytes: 1 << 20,
    }[why]
    assert again(slot, epoch=2)
    # Triton's own path (it makes a fresh scratch): grid, stream, function, metadata, hooks, arguments.
    assert launcher.triton_calls == [(3, 1, 1, "stream-0", "fn-handle", "packed", None, None, None,
                                      first.data_ptr(), 7, 2, 32)]  # fmt: skip
    assert launcher.entry_calls == []


def test_relaunch_declines_a_misaligned_tensor(relaunch):
    again, launcher, first = relaunch
    offset = first[1:]  # one byte past a 16-byte boundary
    assert not again(a_ptr=offset, epoch=2)
    assert launcher.entry_calls == launcher.triton_calls == []


def test_relaunch_declines_while_a_launch_hook_is_installed(relaunch):
    again, launcher, _ = relaunch

    def hook(metadata):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not again(epoch=2)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launcher.entry_calls == launcher.triton_calls == []
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


def test_the_descriptor_allocator_is_set_in_every_thread():
    """Triton keeps its allocator per thread, and autograd runs backward on its
    own threads: a thread with none gets ours, one a caller set stays."""
    import threading

    from triton.runtime import _allocation

    seen = {}

    def fresh_thread():
        seen["before"] = _allocation._allocator.get()
        relaunch_module.ensure_descriptor_allocator()
        seen["after"] = _allocation._allocator.get()

    def callers_own():
        def mine(size, align, stream):
            return None

        _allocation._allocator.set(mine)
        relaunch_module.ensure_descriptor_allocator()
        seen["kept"] = _allocation._allocator.get() is mine

    for body in (fresh_thread, callers_own):
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    assert seen["before"] is _allocation._NULL_ALLOCATOR
    assert seen["after"] is relaunch_module._descriptor_scratch
    assert seen["kept"]


def test_a_chunked_gemm_relaunch_passes_its_tail_scratch_once_per_stream(monkeypatch):
    """The split tail's scratch is the current stream's: a relaunch on the stream
    of the launch before keeps passing that one (the Relaunch keeps the addresses)."""
    from overlap_kernels.kernels import gemm as gemm_module

    current, lookups = ["stream-a"], []

    class _Driver:
        class active:
            @staticmethod
            def get_current_stream(device):
                lookups.append(device)
                return current[0]

    monkeypatch.setattr(gemm_module, "driver", _Driver)
    passed, declines = [], [False, False, False, False, False, True, False, False]

    class _Relaunch:  # what ChunkedGemmRelaunch calls: a Relaunch's signature
        device_index = 0

        def __call__(self, scratch=None, stream=None, /, **changed):
            assert stream == current[0]  # the stream it looked up, handed on
            passed.append("tail_partials_ptr" in changed and "tail_counters_ptr" in changed)
            return not declines[len(passed) - 1]

    again = _Relaunch()

    relaunch = gemm_module.ChunkedGemmRelaunch(again, programs=4, tile_elems=16, own_scratch=False)
    a, b, out = torch.zeros(8, 8), torch.zeros(8, 8), torch.zeros(8, 8)
    streams = ["stream-a", "stream-a", "stream-b", "stream-b", "stream-a", "stream-b", "stream-b"]
    for epoch, stream in enumerate(streams):
        current[0] = stream
        assert relaunch(a, b, out, epoch) == (not declines[epoch])
    # (the declined launch on stream-b took nothing: the next one passes the scratch again)
    assert passed == [True, False, True, False, True, True, True]
    assert len(lookups) == len(streams)  # one stream lookup per launch
    own = gemm_module.ChunkedGemmRelaunch(again, programs=4, tile_elems=16, own_scratch=True)
    assert own(a, b, out, 9) and passed[-1] is False  # its own scratch, passed at its first launch
