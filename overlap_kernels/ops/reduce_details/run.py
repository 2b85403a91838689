"""Launching a gemm_rs / gemm_ar plan: the producer GEMM on the caller's stream,
the flag-gated copies on the communication stream (pulls, then the first lane
of gathers) and on one more communication stream per further lane of gathers.

On CUDA both streams run at once; the copies are enqueued first (workspace.py:
``Workspace.overlap`` says why) and every kernel module involved is loaded
once, on the first call with a plan, before anything waits on a flag: loading
a module waits for the running kernels, and a running kernel may be spinning
on a flag that only the kernel being loaded would set.

On the CPU there are no streams: the producer tiles run, then the pulls, then
the reductions (the schedule puts them last when partials are pulled), then
the gathers.

Producer ``cublas``: the pieces of peers' rows are torch.matmul calls, into
this rank's memory (pulled partials, a call per piece) or straight into this
rank's slot in the owner's memory (pushed ones, a call per owner), each
followed by stream writes of the owner's flags (stream order puts them after
the product, and each write's system-wide fence makes the product visible
first; on the CPU the release kernel). The Triton GEMM runs only the
reduction tiles of this rank's own rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...kernels.reduce_gemm import launch_reduce_gemm
from ...kernels.relaunch import launch
from ...kernels.transfer import load_wait_kernel, wait_kernel
from ...limits import DEVICE_EPOCH
from ...runtime.platform import FAST_SIGNALS, cublas_leaves_sms, num_sms
from ...runtime.signals import wait_budget
from ...runtime.workspace import Workspace, get_workspace
from ..checks import check_current_cuda, check_out, new_out, resolve_epilogue, tma_aligned
from ..paths import capturing, say_plain_while_capturing
from ..replay import REPLAY_MAX_BYTES, ReplayState
from .plan import CopyStep, ReducePlan, plan_key, region_bytes

if TYPE_CHECKING:
    from ..gemm_ar import GemmArConfig
    from ..gemm_rs import GemmRsConfig


class ReduceOpPlan:
    """The call of a gemm_rs / gemm_ar plan (ops/plans.py): the fused kernels
    (``fused``), their replayable form while a CUDA graph is captured (where an
    eager call prepared it: ops/replay.py), else the op's plain path (``plain``)."""

    op: str
    cfg: object
    out_shape: tuple[int, int]
    fused: FusedReduce | None
    plain_when_captured: bool = False  # the config asks for the plain pair in CUDA graphs
    word: int = 0  # the signature word its signals carry (plans.plan_for sets it)

    def plain(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x, w, out):
        if out is not None:
            check_out(self.op, out, self.out_shape, x, x, w)
        fused = self.fused
        if fused is None:
            return self.plain(x, w, out)
        device = x.device
        if capturing(device):
            return self._captured(x, w, out)
        if device.type == "cuda":
            check_current_cuda(self.op, device)
        cfg = self.cfg
        if out is None:
            out = new_out(self.out_shape, x)
        else:
            cfg = resolve_epilogue(self.op, cfg, out, self.out_shape[1])
        x, w = tma_aligned(x), tma_aligned(w)
        fused(x, w, out, cfg, self.word)
        if (
            not fused.replay_ready()
            and device.type == "cuda"
            and fused.nbytes // 2 <= REPLAY_MAX_BYTES
            and not self.plain_when_captured
        ):
            fused.prepare_replay(x, w, out, cfg)  # once per plan
        return out

    def _captured(self, x, w, out):
        """While a CUDA graph is captured: the plain path where the config asks
        for it; else the replayable kernels where an eager call of this
        signature, with an ``out`` of the same epilogue and alignment, prepared
        them; else the plain path, saying so."""
        if self.plain_when_captured:
            return self.plain(x, w, out)
        cfg = (
            self.cfg if out is None else resolve_epilogue(self.op, self.cfg, out, self.out_shape[1])
        )
        result = out if out is not None else new_out(self.out_shape, x)
        if self.fused.replay(tma_aligned(x), tma_aligned(w), result, self.word, cfg):
            return result
        say_plain_while_capturing(self.op)
        return self.plain(x, w, out)


class FusedReduce:
    """The fused part of a gemm_rs / gemm_ar plan (ops/plans.py): the
    workspace, the bytes, the wait budget, and the launch plan of each buffer
    half (``build(ws, half)``, made and its kernels loaded on first use).

    Two buffer halves alternate between calls: a peer may still be reading the
    previous call's partials, and it cannot be two calls behind (this call's
    reductions needed its partials of the previous call). Shapes, the config,
    the schedule, the workspace and its plans are kept, never a caller's tensor."""

    def __init__(
        self, op: str, x, w, group, cfg, schedule, build, *, one_shot: bool, scale: float = 1.0
    ):
        self.op, self.cfg, self.schedule, self.build, self.scale = op, cfg, schedule, build, scale
        self.group, self.device = group, x.device
        world = dist.get_world_size(group)
        _, slots_bytes, rows_bytes = region_bytes(
            x.shape[0], w.shape[1], world, x.element_size(), one_shot
        )
        self.nbytes = 2 * (slots_bytes + rows_bytes)  # both buffer halves
        self.budget = wait_budget(cfg.timeout_s)
        # (buffer half, epilogue, out's alignment) -> its plan, while the buffer stays
        self.plans: dict[tuple, ReducePlan] = {}
        # The workspace on the first fused call (its set-up is collective, and a
        # plan made while a graph is captured runs its plain path until then).
        self.ws: Workspace | None = None
        self.buffer = None
        self.replay_state: ReplayState | None = None  # what a capture of this plan runs
        # (epilogue, out's alignment) of the eager calls made: their kernels are loaded,
        # so a capture with such an out may replay them (kernels/relaunch.py: alignment)
        self.eager_outs: set[tuple[str, int]] = set()

    def __call__(self, x, w, out, cfg, word: int) -> None:
        """One eager call (no CUDA graph captured: the caller saw to it, as ReduceOpPlan
        does) into ``out`` (``cfg``: the plan's, or its pointer-epilogue twin where ``out``
        is not aligned for TMA stores) with signature ``word``: next epoch, the buffer
        half's plan, the launches."""
        ws = self.ws
        if ws is None:
            ws = self.ws = get_workspace(self.group, self.device, self.op, cfg.timeout_s)
        epoch = ws.begin(self.op, self.nbytes, cfg.timeout_s, capture_checked=True)
        if ws.buffer is not self.buffer:  # grown for another call: plans for the new one
            self.plans, self.buffer = {}, ws.buffer
        # (the buffer half by the epoch's parity; Triton compiles per pointer alignment: plan_key)
        key = (epoch & 1, cfg.epilogue, out.data_ptr() % 16)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._launch_plan(
                ws, ws.half_offset(epoch), x, w, out, cfg, load=True
            )
            # The other half's now too, so later calls allocate nothing (a graph
            # warm-up's memory pool must not keep what they would). Its kernels are
            # the ones just loaded, and loading them again could write a cuBLAS
            # producer's warm-up products into a half a peer may still be reading.
            self.plans[((epoch + 1) & 1, *key[1:])] = self._launch_plan(
                ws, ws.half_offset(epoch + 1), x, w, out, cfg, load=False
            )
        run_plan(ws, plan, x, w, out, cfg, epoch, self.budget, self.scale, word)
        ws.finish()
        self.eager_outs.add(key[1:])

    def _launch_plan(self, ws: Workspace, half: int, x, w, out, cfg, *, load: bool) -> ReducePlan:
        """The workspace's plan for ``half``, built where it has none (and, with
        ``load``, its kernels loaded)."""
        key = plan_key(self.op, self.schedule, cfg, x, w, out, half)
        plan = ws.cache.get(key)
        if plan is None:
            plan = ws.cache[key] = self.build(ws, half)
            if load:
                load_modules(ws, plan, x, w, out, cfg, self.budget)
        return plan

    # ---- calls captured in CUDA graphs (ops/replay.py) ----------------------

    def prepare_replay(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        cfg: GemmRsConfig | GemmArConfig,
    ) -> None:
        """On an eager call (every rank makes it): the replay state, with this
        plan's kernels loaded there. One buffer half: replays do not alternate."""
        if self.replay_ready():
            return

        def build(ws: Workspace, offset: int) -> ReducePlan:
            plan = self.build(ws, offset)
            load_modules(ws, plan, x, w, out, cfg, self.budget)
            ws.comm_streams(max(1, len(plan.gathers)))  # (run_plan's lanes)
            return plan

        eager_plan = next(iter(self.plans.values()))  # (any half's: they differ in offsets only)
        self.replay_state = ReplayState.prepare(
            self.ws, self.op, self.nbytes // 2, cfg.timeout_s, self.budget, build,
            one_launch=eager_plan.one_launch,
        )  # fmt: skip

    def replay_ready(self) -> bool:
        return self.replay_state is not None and self.replay_state.current()

    def replay(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, word: int, cfg) -> bool:
        """Enqueue this call into ``out`` (``cfg``: the plan's, with the epilogue ``out``
        allows), with signature ``word``, as a capture replays it; False, nothing
        enqueued, where no eager call prepared it or none had such an ``out``."""
        if not self.replay_ready() or (cfg.epilogue, out.data_ptr() % 16) not in self.eager_outs:
            return False
        state = self.replay_state
        state.enter(word)
        run_plan(state.ws, state.plan, x, w, out, cfg, state.epoch, self.budget, self.scale, word,
                 half_bytes=state.half_bytes)  # fmt: skip
        return True


def _gemm(ws: Workspace, plan: ReducePlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg,
          epoch: int, budget: int, scale: float, word: int, first: int, stop: int, half_bytes: int) -> None:  # fmt: skip
    """The producer GEMM over tiles [first, stop) of the plan's table, relaunched
    with the plan's arguments bound once (kernels/relaunch.py) after its first launch;
    its launch scratch where the workspace keeps one (Workspace.launch_scratch: eager calls)."""
    if stop <= first:
        return
    again = plan.relaunches.get(first)
    scratch = ws.launch_scratch if epoch > DEVICE_EPOCH else None
    if again is not None and again(scratch, a_ptr=a, b_ptr=b, out_ptr=out, scale=scale, epoch=epoch, word=word):  # fmt: skip
        return
    plan.relaunches[first] = launch_reduce_gemm(
        a, b, out, plan.tiles[first:], stop - first, cfg, num_sms(a.device) - cfg.comm_sms, ws=ws,
        slots_offset=plan.slots_offset, slot_rows=plan.slot_rows, rows_offset=plan.rows_offset,
        wait_stride=plan.wait_stride, epoch=epoch, wait_budget=budget, scale=scale,
        fast_signals=FAST_SIGNALS, word=word, half_bytes=half_bytes,
    )  # fmt: skip


def run_plan(
    ws: Workspace,
    plan: ReducePlan,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmRsConfig | GemmArConfig,
    epoch: int,
    budget: int,
    scale: float,
    word: int,
    *,
    half_bytes: int = 0,
) -> None:
    """Enqueue one call of ``plan`` in ``ws``, with signature ``word``: the producer
    GEMM on the caller's stream, the flag-gated copies beside it (module docstring);
    CPU: one after another. ``half_bytes``: a replayed call of one launch picks its
    buffer half on the device (ops/replay.py)."""
    if ws._cuda and plan.one_launch:
        # One launch, nothing beside it (decode sizes, pushed partials): no lanes to set up.
        _gemm(ws, plan, a, b, out, cfg, epoch, budget, scale, word, plan.gemm_start, plan.num_tiles,
              half_bytes)  # fmt: skip
        return

    def gemm(first: int, count: int) -> None:
        _gemm(
            ws, plan, a, b, out, cfg, epoch, budget, scale, word, first, first + count, half_bytes
        )

    def wait(step: CopyStep) -> None:
        # Relaunched like the GEMM: a call makes a few of these waits per owner,
        # and Triton's own launch path redoes per-call work a relaunch skips
        # (kernels/relaunch.py), where a decode-size call's host time is its time.
        key = ("wait", step.wait_slot)
        again = plan.relaunches.get(key)
        if again is not None and again(epoch=epoch, budget=budget, word=word):
            return
        args = (
            ws.chunk_flags,
            step.wait_slot,
            epoch,
            ws.error_address,
            budget,
            step.peer,
            word,
            FAST_SIGNALS,
        )
        plan.relaunches[key] = launch(wait_kernel, (1,), args, {}, a.device)

    def copies(steps: tuple[CopyStep, ...]) -> None:
        for step in steps:
            wait(step)
            dst = step.dst if step.dst is not None else out[step.rows[0] : step.rows[1]]
            dst.copy_(step.src)
            if step.done_slot >= 0:
                ws.signal_from_stream(step.done_slot, epoch)

    def produce(stop: int) -> None:
        """Tiles [0, stop), the producer tiles by cuBLAS where asked."""
        if plan.staged:
            stage_by_cublas(ws, plan, a, b, epoch, cfg.comm_sms, word)
        gemm(plan.gemm_start, stop - plan.gemm_start)

    if a.device.type != "cuda":
        split = plan.num_producer_tiles if plan.pulls else plan.num_tiles
        produce(split)
        copies(plan.pulls)
        gemm(split, plan.num_tiles - split)
        for lane in plan.gathers:
            copies(lane)
        return
    if not plan.pulls and not plan.gathers:
        produce(plan.num_tiles)
        return
    first, *more = plan.gathers or ((),)
    ws.overlap(
        communicate=lambda: copies(plan.pulls + first),
        compute=lambda: produce(plan.num_tiles),
        beside=[lambda lane=lane: copies(lane) for lane in more],
    )


def stage_by_cublas(
    ws: Workspace,
    plan: ReducePlan,
    a: torch.Tensor,
    b: torch.Tensor,
    epoch: int | None,
    spare_sms: int,
    word: int = 0,
) -> None:
    """The cuBLAS producer: each staged piece of peers' rows (a pushed owner's
    whole segment counts as one: plan.py's StagedPiece) by torch.matmul, then
    (given an ``epoch``) its owner's flags, by stream writes (no kernel between
    two matmuls), the first of a piece's with the call's signature ``word``
    (stream order holds it ahead of the rest). The matmuls leave ``spare_sms``
    (config comm_sms) to the flag waits of pulls and gathers, as our GEMM does.
    Without an epoch (loading the kernels) a pushed piece's product lands in
    the owner's slot unannounced: the owner reads it only after the flag of a
    later call, and a slot is written again only after the owner has read it
    (FusedReduce's two buffer halves), so this is as safe as the call's own write."""
    with cublas_leaves_sms(spare_sms):
        for piece in plan.staged:
            torch.matmul(a[piece.rows[0] : piece.rows[1]], b, out=piece.dst)
            for i, flag in enumerate(piece.flags if epoch is not None else ()):
                ws.signal_from_stream(flag, epoch, piece.owner_flags, word if i == 0 else 0)


def load_modules(
    ws: Workspace,
    plan: ReducePlan,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmRsConfig | GemmArConfig,
    budget: int,
) -> None:
    """Load every kernel a call of ``plan`` launches, with the call's own arguments
    (so the later launch finds the same compiled variant: argument *types* count,
    a budget of 1 is an i32 where the call's is an i64, and Triton specialises
    pointers on 16-byte alignment, so the GEMM loads from the very row of the
    tile table the call starts at), and wait for them. A variant first met
    mid-call would load behind the running flag waits: with gemm_ar's gathers,
    which wait for peers whose own load waits the same way, every rank timed out."""
    if a.device.type != "cuda":
        return
    launch_reduce_gemm(
        a, b, out, plan.tiles[plan.gemm_start :], 0, cfg, num_sms(a.device) - cfg.comm_sms, ws=ws,
        slots_offset=plan.slots_offset, slot_rows=plan.slot_rows, rows_offset=plan.rows_offset,
        wait_stride=plan.wait_stride, epoch=0, wait_budget=budget, fast_signals=FAST_SIGNALS,
    )  # fmt: skip
    if plan.pulls or plan.gathers:
        load_wait_kernel(ws, budget)
    if plan.staged:
        # cuBLAS loads its kernels lazily too, and a peer's pull may be spinning for
        # the very piece this load would hold up: load them now, with the call's
        # shapes, into where the call will write them (stage_by_cublas: why that is safe).
        stage_by_cublas(ws, plan, a, b, None, cfg.comm_sms)
    torch.cuda.synchronize(a.device)
