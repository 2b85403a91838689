"""A reduce FusedOp's plan: gemm_rs's layout (ops/reduce_details/plan.py) with
the user's kernel as its producer: tiles of peers' rows put into their owners'
slots and signalled, own rows' tiles summed once every peer's partial is in.
One launch per call, nothing beside it, so a call replays in a CUDA graph
without an entry (ops/replay.py)."""

from __future__ import annotations

import torch

from ...runtime.workspace import Workspace
from ...schedules import PUSH
from ...schedules.producers import rounds_by_config
from ..checks import require
from ..reduce_details.knobs import check_producer_schedule
from ..reduce_details.plan import ReducePlan as TilePlan
from ..reduce_details.plan import build_two_shot, region_bytes, segment
from ..replay import ReplayState
from .run import FusedPlan


class ReducePlan(FusedPlan):
    """Partials of the [M, N] product on every rank; this rank's rows of their sum out."""

    def __init__(self, fused, x: torch.Tensor, n: int, group, schedule, cfg):
        super().__init__(fused, x, n, group, schedule, cfg)
        world = self.world
        # A rank owning no rows would wait for no partial, and could run two calls
        # ahead of an owner still summing the buffer half it writes (ops/replay.py).
        require(x.shape[0] >= world, self.op,
                f"M = {x.shape[0]} < {world} ranks: every rank must own rows of the sum")  # fmt: skip
        self.schedule = schedule = schedule or rounds_by_config(world, 1, PUSH, None)
        check_producer_schedule(self.op, schedule, world, (PUSH,), cfg)
        self.m, self.dtype = x.shape[0], x.dtype
        self.first_row, stop = segment(self.rank, self.m, world)
        self.out_shape = (stop - self.first_row, n)
        _, slots_bytes, rows_bytes = region_bytes(
            self.m, n, world, x.element_size(), one_shot=False
        )
        self.nbytes = slots_bytes + rows_bytes  # one buffer half
        self._halves: dict[int, TilePlan] = {}  # epoch parity -> its buffer half's plan
        self._buffer = None  # the workspace buffer they were made in

    def _tile_plan(self, ws: Workspace, offset: int) -> TilePlan:
        return build_two_shot(ws, self.schedule, self.m, self.n, self.dtype, self.cfg, offset,
                              publish=False)  # fmt: skip

    def _eager(self, x, operands, out) -> None:
        ws = self.ws
        epoch = ws.begin(self.op, 2 * self.nbytes, self.cfg.timeout_s, capture_checked=True)
        if ws.buffer is not self._buffer:  # new, or grown for another call
            self._halves, self._buffer = {}, ws.buffer
        plan = self._halves.get(epoch & 1)
        if plan is None:
            plan = self._halves[epoch & 1] = self._tile_plan(ws, ws.half_offset(epoch))
        self._launcher(ws, plan, x, operands, out, epoch, 0)()
        ws.finish()

    def _launcher(self, ws: Workspace, plan: TilePlan, x, operands, out, epoch: int,
                  half_bytes: int):  # fmt: skip
        """The launch of ``plan`` in ``ws``: the call's epoch and its buffer half's
        offsets, or a replay's (``half_bytes``: its kernel picks the half)."""
        programs = self.programs(x.device, plan.num_tiles, 0)
        ctx = self.context(ws, epoch, plan.tiles, plan.num_tiles, programs,
                           slots=plan.slots_offset, slot_rows=plan.slot_rows, half_bytes=half_bytes,
                           wait_stride=plan.wait_stride, first_row=self.first_row)  # fmt: skip
        return self.launcher(ws, ctx, x, operands, out)

    def prepare_replay(self, x, operands, out) -> None:
        """After an eager call (every rank makes it): the replay state (ops/replay.py),
        and the kernel loaded with a replay's context."""
        self.replay_state = state = ReplayState.prepare(
            self.ws, self.op, self.nbytes, self.cfg.timeout_s, self.budget, self._tile_plan,
            one_launch=True,
        )  # fmt: skip
        self._launcher(state.ws, state.plan, x, operands, out, state.epoch, state.half_bytes)

    def replay(self, x, operands, out) -> None:
        """Enqueue the call as a capture replays it: one launch, its epoch and half picked on the device."""
        state = self.replay_state
        self._launcher(state.ws, state.plan, x, operands, out, state.epoch, state.half_bytes)()
