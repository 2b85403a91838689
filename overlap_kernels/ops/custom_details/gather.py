"""A gather FusedOp's plan: x published into a gathered buffer in symmetric
memory, peers' rows moved in by ag_gemm's transfer steps in the schedule's
order, and the user's kernel over tiles in that order, each waiting for its chunk."""

from __future__ import annotations

import torch

from ...kernels.reduce_gemm import TILE_COLUMNS
from ...limits import DEVICE_EPOCH
from ...runtime.workspace import Workspace
from ...schedules import COPY_ENGINE, LOCAL, SM_COPY, ChunkSchedule, ring
from ..ag_gemm_details.plan import TransferPlan
from ..ag_gemm_details.plan import make_plan as make_transfer_plan
from ..ag_gemm_details.transfer import announce, publish, transfer
from ..checks import TMA_ALIGN, require
from ..reduce_details.plan import _grouped, _mblocks, _table
from ..replay import ReplayState
from .run import FusedPlan


def tile_row(**values: int) -> tuple[int, ...]:
    """A row of the tile table (kernels/reduce_gemm.py TILE_COLUMNS): ``values``,
    0 elsewhere (no slot to signal: -1)."""
    return tuple(values.get(name, -1 if name == "signal_slot" else 0) for name in TILE_COLUMNS)


def gather_tiles(schedule: ChunkSchedule, rank: int, m_local: int, n: int, cfg,
                 device: torch.device) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The tile table of ``rank``: each chunk's rows, in the schedule's order, cut
    into blocks of cfg.block_m rows (none across chunks) swept over N in groups of
    cfg.group_m; each tile waits on its chunk's flag (-1: own rows); its count."""
    rows = []
    for chunk in schedule.for_rank(rank):
        start, stop = chunk.rows(m_local)
        wait = -1 if chunk.mechanism == LOCAL else chunk.flag
        blocks = _grouped(_mblocks(start, stop, cfg.block_m), -(-n // cfg.block_n), cfg.group_m)
        rows += [tile_row(row_start=row_start, row_stop=row_stop, col_start=nblock * cfg.block_n,
                          owner=chunk.src, wait_slot=wait)
                 for row_start, row_stop, nblock in blocks]  # fmt: skip
    return _table(rows, device), len(rows)


class GatherPlan(FusedPlan):
    """x [M_local, K] gathered into [M_local * world, K]; the output [M_local * world, N]."""

    def __init__(self, fused, x: torch.Tensor, n: int, group, schedule, cfg):
        super().__init__(fused, x, n, group, schedule, cfg)
        op, world = self.op, self.world
        self.schedule = schedule = schedule or ring(world)
        problems = schedule.problems()
        require(
            not problems, op, f"schedule '{schedule.name}' is invalid:\n  " + "\n  ".join(problems)
        )
        require(schedule.mechanisms <= {COPY_ENGINE, SM_COPY}, op,
                f"a gather op's chunks are pulled, by copy_engine or sm_copy; schedule '{schedule.name}' "
                f"has {sorted(schedule.mechanisms - {COPY_ENGINE, SM_COPY})} chunks, which nothing would send")  # fmt: skip
        m_local, k = x.shape
        row_bytes = k * x.element_size()
        require(SM_COPY not in schedule.mechanisms or row_bytes % 16 == 0, op,
                f"sm_copy pulls whole 16-byte words: rows of {row_bytes} bytes are not; use copy_engine")  # fmt: skip
        self.out_shape = (m_local * world, n)
        self.nbytes = m_local * world * row_bytes  # one gathered buffer
        self.tiles, self.num_tiles = gather_tiles(schedule, self.rank, m_local, n, cfg, x.device)
        # One rank whose chunks are all its own rows: no tile waits for a flag.
        self.alone = world == 1 and all(c.mechanism == LOCAL for c in schedule.for_rank(self.rank))
        self._halves: dict[int, TransferPlan] = {}  # epoch parity -> its buffer half's plan
        self._buffer = None  # the workspace buffer they were made in

    def _eager(self, x, operands, out) -> None:
        ws, cfg = self.ws, self.cfg
        epoch = ws.begin(self.op, 2 * self.nbytes, cfg.timeout_s, capture_checked=True)
        if ws.buffer is not self._buffer:  # new, or grown for another call
            self._halves, self._buffer = {}, ws.buffer
        if epoch & 1 not in self._halves:  # both at once: later calls allocate nothing
            for e in (epoch, epoch + 1):
                self._halves[e & 1] = make_transfer_plan(ws, self.schedule, x, ws.half_offset(e),
                                                         cfg.block_m)  # fmt: skip
        self._launch(ws, self._halves[epoch & 1], x, operands, out, epoch)
        ws.finish()

    def _launch(self, ws: Workspace, plan: TransferPlan, x, operands, out, epoch: int) -> None:
        """Publish x, then the announcement and transfers on the communication
        stream beside the user's kernel (Workspace.overlap), or on one rank's eager
        call the kernel alone, on x in place where TMA can read it; a replayed call
        (``epoch`` DEVICE_EPOCH) announces first, on the caller's stream, since its
        announcement counts the device epoch every later kernel reads (ops/replay.py)."""
        programs = self.programs(x.device, self.num_tiles, self.cfg.comm_sms)
        ctx = self.context(ws, epoch, self.tiles, self.num_tiles, programs)
        replayed = epoch == DEVICE_EPOCH
        if self.alone and not replayed and x.data_ptr() % TMA_ALIGN == 0:
            # Nothing to gather: the kernel reads x where it is (TMA, hence aligned), with
            # no copy, announcement or transfer, and nothing on a stream beside it. (A
            # replay keeps its steps: they cost no host time, and its announcement counts
            # the device epoch as on more ranks.)
            self.launcher(ws, ctx, x, operands, out, x)()
            return
        compute = self.launcher(ws, ctx, x, operands, out, plan.gathered)
        publish(plan, x)
        if replayed:
            announce(ws, plan, epoch, self.budget, self.word)

        def communicate() -> None:
            if not replayed:
                announce(ws, plan, epoch, self.budget, self.word)
            transfer(ws, plan, epoch, self.budget, self.cfg.comm_sms, False, self.word)

        ws.overlap(communicate=communicate, compute=compute)

    def prepare_replay(self, x, operands, out) -> None:
        """After an eager call (every rank makes it): the replay state (ops/replay.py),
        and the kernel loaded with a replay's context."""

        def build(ws: Workspace, offset: int) -> TransferPlan:
            ws.comm_streams(1)
            return make_transfer_plan(ws, self.schedule, x, offset, self.cfg.block_m)

        self.replay_state = state = ReplayState.prepare(
            self.ws, self.op, self.nbytes, self.cfg.timeout_s, self.budget, build, one_launch=False
        )
        programs = self.programs(x.device, self.num_tiles, self.cfg.comm_sms)
        self.launcher(state.ws, self.context(state.ws, state.epoch, self.tiles, self.num_tiles, programs),
                      x, operands, out, state.plan.gathered)  # fmt: skip

    def replay(self, x, operands, out) -> None:
        """Enqueue the call as a capture replays it: the entry, then the steps with the device epoch."""
        state = self.replay_state
        state.enter(self.word)
        self._launch(state.ws, state.plan, x, operands, out, state.epoch)
