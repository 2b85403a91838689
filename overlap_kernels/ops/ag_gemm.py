"""ag_gemm: all-gather then matmul, with the gather hidden inside the GEMM.

Problem
    Each rank holds x_local [M_local, K]; every rank holds w [K, N] (row-major,
    or ``weight.t()`` of an nn.Linear weight [N, K]). Every rank computes
    out [M_local * world, N] = all_gather(x_local) @ w.

Algorithm
    1. Publish: copy x_local into this rank's rows of the gathered buffer in
       symmetric memory (two buffers alternate between calls, so a peer still
       reading the previous call's rows is never overwritten).
    2. Transfer, on the communication stream: announce the rows to every peer
       (ready flag = epoch; with gemm "cublas" on the caller's stream, before
       the first matmul takes every SM), then, in the schedule's order, each
       chunk of a peer's rows is pulled into the local gathered buffer by the
       copy engine (then a stream memory operation sets the chunk's flag; on
       CPU a one-thread kernel) or by the SM copy kernel (which sets it itself).
    3. GEMM, on the caller's stream, by config ``gemm``:
       ``triton``   a persistent Triton GEMM walks the chunks in the
                    schedule's order (the factories put this rank's own rows
                    first); each tile waits once on its chunk's flag, then
                    runs its K loop at full speed.
       ``cublas``   one torch.matmul per chunk in the schedule's order, each
                    behind a CUDA event recorded after its copy (copy_engine
                    chunks only): cuBLAS's kernels where they beat ours.
                    With ``cublas_streams = 2`` (the template's from 8192
                    rows) consecutive chunks alternate between the caller's
                    stream and a second one, so that a chunk's matmul fills the
                    SMs its predecessor's last wave leaves idle. With
                    ``cublas_copies = "in_turn"`` each chunk's copy is
                    enqueued on its matmul's stream just before it (no
                    communication stream, no events) instead of every copy
                    ahead on the communication stream.
    Mechanism ``push`` (the template's at decode sizes) replaces steps 1 and 2:
    our GEMM's programs first copy x into this rank's rows of every rank's
    gathered buffer, signal each rank and wait for every source, then run their
    tiles: one launch per call, nothing on a second stream, since at decode
    sizes a call's launches are its time.
    Which consumer runs a shape comes from a tuned table where one covers it
    (tuned.py), else from the template; ``overlap_kernels.autotune()`` measures
    both, the plain path and, with ``pull_sms`` > 0, our GEMM with peers' rows
    pulled by that many SMs. Small problems (config.min_fused_flops) and
    layouts TMA cannot read take the plain path: NCCL all-gather, then
    torch.matmul; on one rank the op is torch's x @ w alone (paths.LocalGemm).
    A call made while a CUDA graph is captured runs the fused kernels as a
    replay runs them, once an eager call of its signature prepared that
    (ops/replay.py), else the plain path. Checks and choices are made once
    per call signature (ops/plans.py).

Signal contract
    runtime/signals.py: ready flags (one per source rank) and chunk flags hold
    the call's epoch; waits are bounded by config.timeout_s and a timeout
    raises OverlapTimeoutError naming op, rank, peer and chunk.

Example (run with ``torchrun --nproc-per-node 4 example.py``)::

    import torch, torch.distributed as dist
    from overlap_kernels import ag_gemm
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    x = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)      # this rank's rows
    weight = torch.randn(7168, 8192, device="cuda", dtype=torch.bfloat16)  # nn.Linear layout
    out = ag_gemm(x, weight.t(), dist.group.WORLD)                         # [8192, 7168]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.gemm import launch_chunked_gemm, new_tail_scratch
from ..limits import DEFAULT_TIMEOUT_S, DEVICE_EPOCH
from ..runtime.collectives import all_gather_single, collective
from ..runtime.platform import FAST_SIGNALS, num_sms
from ..runtime.signals import wait_budget
from ..runtime.workspace import Workspace, get_workspace
from ..schedules import COPY_ENGINE, PUSH, SM_COPY, ChunkSchedule, by_name
from ..schedules.factories import FACTORIES
from ..tuning import build_config, shape_key
from . import autotune
from .ag_gemm_details.plan import TransferPlan
from .ag_gemm_details.plan import make_plan as make_transfer_plan
from .ag_gemm_details.transfer import announce, consume_with_cublas, publish, transfer
from .checks import (
    GemmKnobs,
    check_current_cuda,
    check_epilogue,
    check_gemm_knobs,
    check_gemm_operands,
    check_group,
    check_out,
    check_tiles_fit,
    epilogue_for_new_out,
    new_out,
    refuse_grad,
    require,
    resolve_epilogue,
    tma_aligned,
)
from .paths import (
    LocalGemm,
    caller_set,
    capturing,
    fused_blocker,
    fused_or_sequential,
    local_product,
    say_plain_while_capturing,
)
from .plans import plan_for, signature
from .replay import REPLAY_MAX_BYTES, ReplayState

OP = "ag_gemm"
TRITON, CUBLAS = "triton", "cublas"  # config gemm: what consumes the gathered chunks
AHEAD, IN_TURN = "ahead", "in_turn"  # config cublas_copies: where gemm "cublas" enqueues the copies


@dataclass(frozen=True)
class AgGemmConfig(GemmKnobs):
    """Every knob of ag_gemm; templates/ag_gemm.toml explains each value."""

    schedule: str = "ring"  # factory name; a ChunkSchedule passed to ag_gemm wins
    pieces: int = 1  # each peer's rows arrive in this many chunks
    mechanism: str = "copy_engine"  # or "sm_copy"
    gemm: str = TRITON  # or "cublas" (copy_engine only)
    cublas_streams: int = (
        1  # gemm "cublas": consecutive chunks' matmuls alternate between this many streams
    )
    cublas_copies: str = (
        AHEAD  # gemm "cublas": every copy ahead on the communication stream, or "in_turn"
    )
    comm_sms: int = 1  # SMs the GEMM leaves to communication kernels (>= 1: see template)
    pull_sms: int = (
        0  # autotune: SMs of an sm_copy candidate (our GEMM on the rest); 0: no such candidate
    )
    path: str = "auto"  # "auto" | "fused" | "sequential"
    min_fused_flops: float = 1e11  # "auto" below this takes the sequential path
    timeout_s: float = DEFAULT_TIMEOUT_S
    allow_tf32: bool = False  # fp32 inputs: tf32 tensor cores instead of exact fp32
    split_tail: bool = True  # cut a short last wave's tiles along K (kernels/gemm.py)
    group_by_chunk: bool = (
        False  # our GEMM's tile groups end with each chunk (where all have as many M-blocks)
    )
    epilogue: str = (
        "pointer"  # or "tma": whole blocks stored by asynchronous TMA stores (kernels/gemm.py)
    )

    def validate(self) -> AgGemmConfig:
        def need(ok: bool, what: str) -> None:
            require(ok, OP, f"config: {what}")

        check_gemm_knobs(OP, self)
        check_epilogue(OP, self)
        need(
            self.schedule in FACTORIES,
            f"schedule must be one of {sorted(FACTORIES)}, got '{self.schedule}'",
        )
        need(
            self.mechanism in (COPY_ENGINE, SM_COPY, PUSH),
            f"mechanism must be copy_engine, sm_copy or push, got '{self.mechanism}'",
        )
        need(self.gemm in (TRITON, CUBLAS), f"gemm must be triton or cublas, got '{self.gemm}'")
        need(self.gemm != CUBLAS or self.mechanism == COPY_ENGINE,
             "gemm 'cublas' waits on the copy engine's events: it needs mechanism copy_engine")  # fmt: skip
        need(
            self.cublas_streams in (1, 2),
            f"cublas_streams must be 1 or 2, got {self.cublas_streams}",
        )
        need(
            self.cublas_copies in (AHEAD, IN_TURN),
            f"cublas_copies must be ahead or in_turn, got '{self.cublas_copies}'",
        )
        need(
            self.comm_sms >= 1,
            f"comm_sms must be >= 1 (the ready-flag exchange kernel needs an SM), got {self.comm_sms}",
        )
        need(self.pull_sms >= 0, f"pull_sms must be >= 0, got {self.pull_sms}")
        need(
            isinstance(self.group_by_chunk, bool),
            f"group_by_chunk must be true or false, got {self.group_by_chunk!r}",
        )
        need(
            self.path in ("auto", "fused", "sequential"),
            f"path must be auto, fused or sequential, got '{self.path}'",
        )
        return self


def ag_gemm(
    x: torch.Tensor,  # [M_local, K], this rank's rows
    w: torch.Tensor,  # [K, N]
    group: dist.ProcessGroup | None = None,
    *,
    schedule: ChunkSchedule | None = None,
    config: AgGemmConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [M_local * world, N]
    return_gathered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(x) @ w`` with the gather overlapped with the GEMM.

    Every rank of ``group`` must call it with the same shapes, dtype and config.
    Returns ``out`` [M_local * world, N], and also the gathered x [M, K] (a new
    tensor) when ``return_gathered``. Records no gradient (integrations/ does).
    """
    if config is None and schedule is None:
        product = local_product(OP, group, x, w, out)
        if product is not None:
            return (product, x.clone()) if return_gathered else product
    refuse_grad(OP, x, w)
    key = signature(OP, x, w, group, config, schedule)
    plan = plan_for(OP, key, lambda: make_plan(x, w, group, schedule=schedule, config=config))
    return plan(x, w, out, return_gathered)


def running_config(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: AgGemmConfig | dict | None = None,
) -> AgGemmConfig:
    """The config a call ``ag_gemm(x, w, group, config=config)`` runs (its plan's:
    made now where the signature has none, a collective as the call is)."""
    key = signature(OP, x, w, group, config, None)
    return plan_for(OP, key, lambda: make_plan(x, w, group, schedule=None, config=config)).cfg


def make_plan(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    schedule: ChunkSchedule | None,
    config: AgGemmConfig | dict | None,
) -> AgGemmPlan:
    """The plan of a call signature: every input check, the config, the path;
    inside ``overlap_kernels.autotune()`` the fastest candidate's."""
    check_gemm_operands(OP, x, w, "x", "w")
    group = check_group(OP, group, x.device)
    world = dist.get_world_size(group)
    if schedule is not None:
        require(isinstance(schedule, ChunkSchedule), OP, "schedule must be a ChunkSchedule")
        require(
            schedule.world_size == world,
            OP,
            f"schedule is for {schedule.world_size} ranks, group has {world}",
        )
        problems = schedule.problems()
        require(
            not problems, OP, f"schedule '{schedule.name}' is invalid:\n  " + "\n  ".join(problems)
        )
        require(PUSH not in schedule.mechanisms, OP, "a schedule's chunks are pulled, with 'copy_engine' or "
                "'sm_copy'; config mechanism 'push' pushes every rank's rows at once and takes no schedule")  # fmt: skip
    shape = shape_key(world, x.shape[0] * world, x.shape[1], w.shape[1], x.dtype)
    cfg = build_config(AgGemmConfig, OP, shape, _pulled_if_asked(config, schedule), device=x.device)
    require(schedule is None or cfg.mechanism != PUSH, OP,
            "config mechanism 'push' takes no schedule (every rank's rows arrive at once)")  # fmt: skip
    if schedule is not None and cfg.gemm == CUBLAS:
        require(SM_COPY not in schedule.mechanisms, OP, "config gemm 'cublas' waits on the copy engine's events; "
                "this schedule has sm_copy chunks: use gemm 'triton' or a copy_engine schedule")  # fmt: skip

    def make(changes: dict) -> AgGemmPlan:
        return AgGemmPlan(x, w, group, schedule, dataclasses.replace(cfg, **changes).validate(),
                          forced=caller_set(config, "path"))  # fmt: skip

    plan = make({})
    if world == 1:  # nothing to gather: the op is x @ w (paths.LocalGemm)
        return LocalGemm(OP, plan.cfg, plan.out_shape)
    if schedule is not None or fused_blocker(x, w, world, "gather"):
        return plan
    pulled = (
        ({"path": "fused", "gemm": TRITON, "mechanism": SM_COPY, "comm_sms": cfg.pull_sms},)
        if cfg.pull_sms
        else ()
    )
    changes = ({"path": "fused", "gemm": TRITON}, {"path": "fused", "gemm": CUBLAS, "mechanism": COPY_ENGINE},
               *pulled, {"path": "sequential"})  # fmt: skip
    return autotune.fastest_plan(
        OP, plan, shape=shape, config=config, changes=changes, make=make,
        x=x, w=w, group=group,
    )  # fmt: skip


def _pulled_if_asked(
    config: AgGemmConfig | dict | None, schedule: ChunkSchedule | None
) -> AgGemmConfig | dict | None:
    """``config``, with mechanism copy_engine where the caller's schedule or gemm
    "cublas" asks for pulled rows and the caller names no mechanism: a template's
    or table's push (decode sizes) gives way, since a schedule's chunks are pulled
    and cuBLAS waits on the copy engine's events."""
    if not isinstance(config, (dict, type(None))) or caller_set(config, "mechanism"):
        return config
    if schedule is None and (config or {}).get("gemm") != CUBLAS:
        return config
    return {**(config or {}), "mechanism": COPY_ENGINE}


class AgGemmPlan:
    """What a call of one signature runs (ops/plans.py): the plain pair, or the fused kernels."""

    word = 0  # the signature word its signals carry (plans.plan_for sets it)

    def __init__(self, x, w, group, schedule, cfg: AgGemmConfig, *, forced: bool):
        world = dist.get_world_size(group)
        flops = 2.0 * x.shape[0] * world * x.shape[1] * w.shape[1]
        cfg = fused_or_sequential(
            OP, cfg, fused_blocker(x, w, world, "gather"), flops, tuple(x.shape), forced=forced
        )
        self.group, self.world, self.out_shape, self.fused, self.ws = (
            group,
            world,
            (x.shape[0] * world, w.shape[1]),
            False,
            None,
        )
        self.gathered_shape = (x.shape[0] * world, x.shape[1])  # the plain path's buffer
        if cfg.path != "sequential":
            check_tiles_fit(OP, cfg, x.dtype, x.device, store_buffer=cfg.epilogue == "tma")
            cfg = epilogue_for_new_out(OP, cfg, w.shape[1], x.dtype)
            self.schedule = schedule or by_name(cfg.schedule, world, cfg.mechanism, cfg.pieces)
            self.fused = (
                True  # the workspace comes with the first fused call (FusedReduce says why)
            )
            self.budget = wait_budget(cfg.timeout_s)
            self.programs = num_sms(x.device) - cfg.comm_sms
            # buffer half (its parity) -> its plan, while the buffer stays
            self.transfer_plans: dict[int, TransferPlan] = {}
            self.buffer = None
            self.nbytes = x.shape[0] * world * x.shape[1] * x.element_size()  # one gathered buffer
            self.replay_state: ReplayState | None = None  # what a capture runs (ops/replay.py)
            # (epilogue, out's alignment) of the eager calls made: their GEMM is loaded,
            # so a capture with such an out may replay it
            self.eager_outs: set[tuple[str, int]] = set()
            self.replay_scratch = None
        self.cfg = cfg

    def __call__(self, x, w, out, return_gathered: bool = False):
        if not self.fused:
            return self.plain(x, w, out, return_gathered)
        cfg = self.cfg
        if out is not None:
            check_out(OP, out, self.out_shape, x, x, w)
            cfg = resolve_epilogue(OP, cfg, out, self.out_shape[1])
        else:  # (a new out suits the plan's epilogue: epilogue_for_new_out)
            out = new_out(self.out_shape, x)
        device = x.device
        if device.type == "cuda":
            check_current_cuda(OP, device)
        gathered = None
        if not capturing(device):
            gathered = self._fused(x, tma_aligned(w), cfg, out)
            self.eager_outs.add((cfg.epilogue, out.data_ptr() % 16))
            state = self.replay_state
            if (
                (state is None or not state.current())
                and device.type == "cuda"
                and self.nbytes <= REPLAY_MAX_BYTES
            ):
                self.prepare_replay(x, cfg)  # once per plan
        else:
            gathered = self.replay(x, tma_aligned(w), out, return_gathered, cfg)
        if gathered is None:
            say_plain_while_capturing(OP)
            return self.plain(x, w, out, return_gathered)
        return (out, gathered.clone()) if return_gathered else out

    def plain(self, x, w, out, return_gathered: bool = False):
        """The plain pair, with as little host work as the caller's own: NCCL's
        all-gather into a new buffer, then torch.mm (torch.matmul's for two
        matrices, one dispatch less)."""
        if out is not None:
            check_out(OP, out, self.out_shape, x, x, w)
        gathered = new_out(self.gathered_shape, x)
        collective(OP, "all-gather", all_gather_single, gathered, x, group=self.group,
                   timeout_s=self.cfg.timeout_s)  # fmt: skip
        out = torch.mm(gathered, w, out=out) if out is not None else torch.mm(gathered, w)
        return (out, gathered) if return_gathered else out

    def prepare_replay(self, x: torch.Tensor, cfg: AgGemmConfig) -> None:
        """On an eager call (every rank makes it): the replay state of this plan,
        its kernels loaded by the eager call's identical launches (ops/replay.py)."""
        if self.replay_state is not None and self.replay_state.current():
            return

        def build(ws: Workspace, offset: int) -> TransferPlan:
            ws.comm_streams(1)
            ws.compute_streams(cfg.cublas_streams)
            # The split tail's scratch of the replays' own: a stream's would be allocated
            # while capturing, in the graph's pool, and shared by graphs replayed at once.
            self.replay_scratch = new_tail_scratch(
                x.device, self.programs, cfg.block_m * cfg.block_n
            )
            return make_transfer_plan(ws, self.schedule, x, offset, cfg.block_m)

        self.replay_state = ReplayState.prepare(
            self.ws, OP, self.nbytes, cfg.timeout_s, self.budget, build,
            one_launch=self.schedule.mechanisms == {PUSH},
        )  # fmt: skip

    def replay(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        return_gathered: bool = False,
        cfg: AgGemmConfig | None = None,
    ) -> torch.Tensor | None:
        """Enqueue this call into ``out`` (``cfg``: the plan's, with the epilogue
        ``out`` allows) as a capture replays it; the gathered buffer. None, nothing
        enqueued, where no eager call prepared it or none had such an ``out``, or
        where the caller wants the gathered rows of a push, whose buffer half a
        replay picks on the device (a captured copy of them would read a fixed one)."""
        cfg = cfg or self.cfg
        state = self.replay_state
        if state is None or not state.current() or (return_gathered and state.one_launch):
            return None
        if (cfg.epilogue, out.data_ptr() % 16) not in self.eager_outs:
            return None
        state.enter(self.word)
        return self._launch(state.ws, state.plan, x, w, cfg, out, state.epoch)

    def _transfer_plan(self, x, epoch: int) -> TransferPlan:
        """The plan of ``epoch``'s buffer half (the gathered buffers of consecutive
        calls alternate). Both halves' are made on the first call, so later calls
        allocate nothing (a graph warm-up's memory pool must not keep what they would)."""
        ws = self.ws
        if ws.buffer is not self.buffer:  # new, or grown for another call: plans for the new one
            self.transfer_plans, self.buffer = {}, ws.buffer
        plan = self.transfer_plans.get(epoch & 1)  # (keyed by the half's parity)
        if plan is None:
            for e in (epoch, epoch + 1):
                self.transfer_plans[e & 1] = make_transfer_plan(
                    ws, self.schedule, x, ws.half_offset(e), self.cfg.block_m
                )
            plan = self.transfer_plans[epoch & 1]
        return plan

    def _fused(self, x, w, cfg: AgGemmConfig, out) -> torch.Tensor:
        if self.ws is None:
            self.ws = get_workspace(self.group, x.device, OP, cfg.timeout_s)
        ws = self.ws
        # (__call__ saw that no graph is captured)
        epoch = ws.begin(OP, 2 * self.nbytes, cfg.timeout_s, capture_checked=True)
        gathered = self._launch(ws, self._transfer_plan(x, epoch), x, w, cfg, out, epoch)
        ws.finish()
        return gathered

    def _launch(
        self, ws, plan: TransferPlan, x, w, cfg: AgGemmConfig, out, epoch: int
    ) -> torch.Tensor:
        """Enqueue one call's steps with ``plan`` in ``ws`` (an eager call's epoch,
        or in the replay workspace its ReplayState's: ops/replay.py); the gathered buffer
        (a replayed push's is in the half the device picks)."""
        budget = self.budget
        if plan.push is not None:  # one launch: the GEMM pushes x itself (kernels/gemm.py)
            self._gemm(ws, plan, x, w, cfg, out, epoch)
            return plan.gathered
        publish(plan, x)
        by_event = cfg.gemm == CUBLAS
        # A replayed call's announcement counts the epoch its later kernels read: it
        # comes before all of them, on the caller's stream.
        announce_first = by_event or epoch == DEVICE_EPOCH
        if announce_first:
            # With cuBLAS, the announcement on the caller's stream before the first
            # matmul: cuBLAS's kernels hold every SM until they end, so on the communication
            # stream it would wait for the own rows' product, and every copy with it,
            # while the GEMM idles (docs/performance.md, "ag_gemm"). Our GEMM
            # leaves SMs free, so with it the announcement stays on the communication stream.
            announce(ws, plan, epoch, budget, self.word)
        in_turn = by_event and cfg.cublas_copies == IN_TURN

        def compute() -> None:
            if by_event:
                consume_with_cublas(
                    plan, w, out, ws.compute_streams(cfg.cublas_streams), copy_in_turn=in_turn
                )
                return
            self._gemm(ws, plan, x, w, cfg, out, epoch)

        def communicate() -> None:
            if not announce_first:
                announce(ws, plan, epoch, budget, self.word)
            transfer(ws, plan, epoch, budget, cfg.comm_sms, by_event, self.word)

        if in_turn:
            compute()  # the copies too, each on its matmul's stream
        else:
            ws.overlap(communicate=communicate, compute=compute)
        return plan.gathered

    def _gemm(
        self,
        ws: Workspace,
        plan: TransferPlan,
        x: torch.Tensor,
        w: torch.Tensor,
        cfg: AgGemmConfig,
        out: torch.Tensor,
        epoch: int,
    ) -> None:
        """Our GEMM over the gathered rows, relaunched where the plan has launched it
        (a transfer plan serves every N: keyed by this plan, epilogue and out's row stride)."""
        key = (self, cfg.epilogue, out.stride(0))
        again = plan.relaunches.get(key)
        pushed = None
        if plan.push is not None:  # (the push copies 16-byte vectors from x's base)
            pushed = tma_aligned(x if x.is_contiguous() else x.contiguous())
        # (The launch scratch in the workspace where it may be: Workspace.launch_scratch.)
        replayed = epoch <= DEVICE_EPOCH
        scratch = ws.launch_scratch if not replayed else None
        if again is None or not again(plan.gathered, w, out, epoch, scratch, pushed, self.word):
            plan.relaunches[key] = launch_chunked_gemm(
                plan.gathered, w, out, plan.mblocks, cfg, self.programs,
                chunk_flags=ws.chunk_flags, epoch=epoch, err_addr=ws.error_address,
                wait_budget=self.budget, fast_signals=FAST_SIGNALS,
                scratch=self.replay_scratch if replayed else None,
                push=plan.push, push_src=pushed, word=self.word,
                group_span=plan.chunk_mblocks if cfg.group_by_chunk else None,
                half_bytes=self.replay_state.half_bytes if replayed else 0,
            )  # fmt: skip
