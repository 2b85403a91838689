"""What a FusedOp's plans of both kinds share: a call (eager, or while a CUDA
graph is captured), the device context of a launch, and the user's launch,
its kernel loaded before anything waits on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import triton.language as tl
from triton.runtime.jit import JITFunction

from ...kernels.relaunch import POINTER_ALIGN, Relaunch, ensure_descriptor_allocator, launch
from ...language import WIDE, Context
from ...runtime.platform import FAST_SIGNALS, num_sms
from ...runtime.signals import wait_budget
from ...runtime.workspace import Workspace, get_workspace
from ..checks import check_current_cuda, check_out, require
from ..paths import capturing
from ..replay import REPLAY_MAX_BYTES

if TYPE_CHECKING:
    from ..custom import FusedConfig, FusedOp

_FAST = tl.constexpr(FAST_SIGNALS)  # (a constexpr in the context: each signal path compiled alone)


class Run:
    """One call as the user's ``launch(run, x, *operands)`` sees it: ``ctx``, the
    device context to pass the kernel (language.Context); ``out``, the output;
    ``gathered``, a gather op's rows [M, K] in symmetric memory (they arrive
    chunk by chunk; None for reduce ops); ``block_m`` x ``block_n``, the tile
    shape the tile table was cut with; ``programs``, the grid; :meth:`launch`."""

    def __init__(self, ctx: Context, out: torch.Tensor, gathered: torch.Tensor | None,
                 cfg: FusedConfig, load: bool, relaunches: dict, scratch: Callable | None):  # fmt: skip
        self.ctx, self.out, self.gathered = ctx, out, gathered
        self.block_m, self.block_n, self.programs = cfg.block_m, cfg.block_n, ctx.programs
        self._load = load
        self._relaunches, self._scratch = relaunches, scratch
        self.launched = 0

    def launch(self, kernel, *args, **kwargs) -> None:
        """``kernel[(run.programs,)](*args, **kwargs)``: the grid the tile claim
        expects (every program calls language.finish once). Before a workspace's
        first call the op has it launched with no programs first: its module is
        then loaded before anything waits on it (a module load waits for the
        kernels running on the device, which may be waiting for this one). Later
        launches with the same arguments but tensors and the context are relaunched
        (kernels/relaunch.py): Triton's own launch binds and specialises every
        argument, the context's fields too, which costs a short call most of its
        host time; an eager relaunch keeps Triton's scratch in the workspace's
        (Workspace.launch_scratch) instead of a new buffer."""
        self.launched += 1
        grid = (0 if self._load else self.programs,)
        relaunchable = (
            not self._load and self.out.device.type == "cuda" and isinstance(kernel, JITFunction)
        )
        key, moving = _relaunch_key(kernel, grid, args, kwargs) if relaunchable else (None, {})
        again = self._relaunches.get(key)
        if again is not None and again(self._scratch, **moving):
            return
        if self.out.device.type == "cuda":
            ensure_descriptor_allocator()  # (the scratch of tl.make_tensor_descriptor)
        if key is None or again is not None:  # (nothing to relaunch by; or a launch hook is set)
            kernel[grid](*args, **kwargs)
            return
        if len(self._relaunches) >= MAX_RELAUNCHES:  # (a scalar that changes every call)
            self._relaunches.clear()
        self._relaunches[key] = launch(kernel, grid, args, kwargs, self.out.device)


# Relaunches a plan keeps, at most: one per kernel and argument values in practice.
MAX_RELAUNCHES = 8
# Arguments a relaunch may find unchanged by value (anything else is launched the normal way).
_KEYED = (bool, int, float, str, type(None), torch.dtype)


def _relaunch_key(
    kernel: JITFunction, grid: tuple, args: tuple, kwargs: dict
) -> tuple[tuple | None, dict]:
    """(what a relaunch must find unchanged, the arguments it passes anew): tensors (by
    dtype; aligned as the kernel's compiled variant assumes) and the context move; every
    other argument is part of the key, by type and value (Triton compiles 1, 1.0 and
    True apart). The context's fields keep their specialisation from call to call (its
    epochs and offsets are widened: language.WIDE), and its grid is the plan's. None,
    nothing to relaunch by, where a tensor is not aligned or an argument is neither of
    these nor a plain value (a tuple of tensors, a host tensor descriptor)."""
    key: list = [kernel, grid, len(args)]
    moving = {}
    for name, value in (*zip(kernel.arg_names, args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            if value.data_ptr() % POINTER_ALIGN:
                return None, {}
            moving[name] = value
            key.append((name, value.dtype))
        elif isinstance(value, Context):
            moving[name] = value
        elif isinstance(value, _KEYED) or (
            isinstance(value, tuple) and all(isinstance(v, _KEYED) for v in value)
        ):
            key.append((name, type(value), value))
        else:
            return None, {}
    return tuple(key), moving


class FusedPlan:
    """A call signature's plan (ops/plans.py). A kind provides ``out_shape``,
    ``nbytes`` (its buffers in a replay workspace), ``_eager``, ``prepare_replay``
    and ``replay``."""

    word = 0  # the signature word (plans.plan_for sets it)
    out_shape: tuple[int, int]
    nbytes: int

    def __init__(self, fused: FusedOp, x: torch.Tensor, n: int, group, schedule, cfg: FusedConfig):
        self.fused, self.op, self.cfg, self.group, self.n = fused, fused.name, cfg, group, n
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.schedule = schedule
        self.budget = wait_budget(cfg.timeout_s)
        self.ws: Workspace | None = None
        self.replay_state = None  # ops/replay.ReplayState, prepared by an eager call (CUDA)
        # (workspace id, pointer alignments) whose kernel variant is loaded: launcher()
        self._loaded: set[tuple] = set()
        self._relaunches: dict[tuple, Relaunch | None] = {}  # Run.launch's, by _relaunch_key

    def __call__(self, x: torch.Tensor, operands: tuple, out: torch.Tensor | None) -> torch.Tensor:
        tensors = [v for v in operands if isinstance(v, torch.Tensor)]
        if out is not None:
            check_out(self.op, out, self.out_shape, x, x, *tensors)
        else:
            out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)
        device = x.device
        if capturing(device):
            state = self.replay_state
            require(state is not None and state.current(), self.op,
                    "captured in a CUDA graph before an eager call of this signature prepared its replay "
                    f"(or its buffers exceed a replay's {REPLAY_MAX_BYTES} bytes): call it eagerly "
                    "on every rank first")  # fmt: skip
            self.replay(x, operands, out)
            return out
        if device.type == "cuda":
            check_current_cuda(self.op, device)
        if self.ws is None:
            self.ws = get_workspace(self.group, device, self.op, self.cfg.timeout_s)
        self._eager(x, operands, out)
        if device.type == "cuda" and self.replay_state is None and self.nbytes <= REPLAY_MAX_BYTES:
            self.prepare_replay(x, operands, out)
        return out

    def programs(self, device: torch.device, tiles: int, spare_sms: int) -> int:
        """The grid: config ``programs``, else an SM each but ``spare_sms``; at most one per tile."""
        return max(1, min(self.cfg.programs or num_sms(device) - spare_sms, tiles))

    def context(self, ws: Workspace, epoch: int, tiles: torch.Tensor, num_tiles: int,
                programs: int, *, slots: int = 0, slot_rows: int = 0, half_bytes: int = 0,
                wait_stride: int = 0, first_row: int = 0) -> Context:  # fmt: skip
        """The device context of a launch in ``ws`` (epoch and offset widened: language.WIDE)."""
        counters = ws.counters
        return Context(tiles, num_tiles, programs, counters, counters.numel() - 2, ws.chunk_flags,
                       ws.peer_table, ws.rank, ws.world, slots + WIDE, slot_rows, self.n,
                       half_bytes, wait_stride, first_row, epoch * 16 + WIDE, ws.error_address,
                       self.budget, self.word, _FAST)  # fmt: skip

    def launcher(self, ws: Workspace, ctx: Context, x: torch.Tensor, operands: tuple,
                 out: torch.Tensor, gathered: torch.Tensor | None = None) -> Callable[[], None]:  # fmt: skip
        """The user's launch with ``ctx``, to call when the call enqueues it. Where
        ``ws`` has not run the kernel with tensors aligned as these (CUDA, no capture)
        it is launched now with no programs and waited for: loaded before the
        call's waits (Run.launch). A capture that would load one raises instead."""

        def call(load: bool) -> None:
            scratch = None if capturing(x.device) else ws.launch_scratch  # (eager calls only)
            run = Run(ctx, out, gathered, self.cfg, load, self._relaunches, scratch)
            self.fused.launch(run, x, *operands)
            require(run.launched == 1, self.op,
                    f"launch(run, ...) must call run.launch once; it called it {run.launched} times")  # fmt: skip
            # On the CPU the launch has ended: its claim words are read without a sync.
            if x.device.type == "cpu":
                claim = ws.counters[ctx.claim : ctx.claim + 2]
                if claim.any():
                    claim.zero_()  # (so that the next call claims its tiles from the first)
                    require(False, self.op, "every program of the kernel must call language.finish(ctx) "
                            "once, last: the claim of tiles was not reset (the next call would skip its tiles)")  # fmt: skip

        # Triton compiles a variant per 16-byte alignment of each pointer argument.
        loaded = (
            id(ws),
            *(t.data_ptr() % POINTER_ALIGN == 0 for t in (x, out, *operands) if _tensor(t)),
        )
        if x.device.type == "cuda" and loaded not in self._loaded:
            require(not capturing(x.device), self.op,
                    "captured in a CUDA graph with tensors aligned otherwise (to 16 bytes) than those of "
                    "every eager call, so its kernel would be compiled and loaded while capturing: make "
                    "an eager call with tensors aligned like these first")  # fmt: skip
            call(True)
            torch.cuda.synchronize(x.device)
            self._loaded.add(loaded)
        return lambda: call(False)


def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor)
