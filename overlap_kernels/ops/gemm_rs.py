"""gemm_rs: matmul then reduce-scatter, with the reduction hidden inside the GEMM.

Problem
    Each rank holds x [M, K_local] and w [K_local, N] (row-major, or
    ``weight.t()`` of an nn.Linear weight [N, K_local]); the product of the
    full K is the sum over ranks of x @ w. Rank r returns its rows of that sum,
    [r * M // world, (r + 1) * M // world), so when M is not a multiple of the
    world size the slices differ by at most one row (M = 10 on 4 ranks: 2, 3,
    2, 3 rows). ``reduce_op="avg"`` divides the sum by the world size.

Algorithm
    A persistent Triton GEMM (kernels/reduce_gemm.py) computes the rows other
    ranks own first, in the order of a producer schedule (schedules/producers.py;
    default ``rounds``: rank r computes the rows of r+1, r+2, ... so that every
    owner receives from one peer at a time, its own rows last). Each finished
    tile of a peer's rows goes to that peer, by one of two mechanisms:
      ``push``         the epilogue stores the tile straight into the owner's
                       symmetric memory, one slot per source rank;
      ``copy_engine``  the epilogue stores it into this rank's symmetric memory
                       and the owner pulls each finished piece with the copy
                       engine on its communication stream.
    Config ``producer = "cublas"`` computes the pieces of peers' rows with
    torch.matmul instead, then stream writes set the owner's flags. With
    ``push`` one matmul per owner writes straight into the owner's slot (no
    transfer follows it for smaller pieces to start sooner); with
    ``copy_engine`` one per piece, into this rank's memory, for the owner to pull.
    The Triton GEMM then runs only this rank's own rows, with the reduction
    in its epilogue.
    Which of these runs a shape comes from a tuned table where one covers it
    (tuned.py; the copy engine's speed differs between hosts), else from the
    template; ``overlap_kernels.autotune()`` measures them all and the plain path.
    The tile that completes a piece signals the owner. The owner computes its
    own rows last; each of those tiles waits for every peer's partial, adds
    them to its fp32 accumulator in rank order and stores the sum.
    Small problems (config.min_fused_flops) and layouts TMA cannot read take
    the plain path: torch.matmul, then the NCCL reduce-scatter; on one rank
    the op is torch's x @ w alone (paths.LocalGemm). A call made while a
    CUDA graph is captured runs the fused kernels as a replay runs them, once
    an eager call of its signature prepared that (ops/replay.py), else the
    plain path.
    The checks and choices are made once per call signature (ops/plans.py).

Numerics
    Partials travel in the output dtype (as they do through NCCL), and are summed
    in fp32 with the owner's unrounded partial; ``avg`` scales in fp32 before the
    one final rounding.

Signal contract
    runtime/signals.py; flag slots in reduce_details/plan.py. Waits are bounded
    by config.timeout_s; a timeout raises OverlapTimeoutError naming op, rank,
    peer and flag slot.

Example (run with ``torchrun --nproc-per-node 4 example.py``)::

    import torch, torch.distributed as dist
    from overlap_kernels import gemm_rs
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    x = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)       # this rank's K slice
    weight = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)  # nn.Linear layout [N, K_local]
    out = gemm_rs(x, weight.t(), dist.group.WORLD)                         # [2048, 8192]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..limits import DEFAULT_TIMEOUT_S
from ..runtime.collectives import collective, reduce_scatter_single, start_collective
from ..runtime.workspace import Workspace
from ..schedules import COPY_ENGINE, PUSH, ChunkSchedule
from ..schedules.producers import rounds_by_config
from ..tuning import build_config, shape_key
from . import autotune
from .checks import (
    GemmKnobs,
    check_epilogue,
    check_gemm_knobs,
    check_gemm_operands,
    check_group,
    check_tiles_fit,
    epilogue_for_new_out,
    is_nccl,
    new_out,
    refuse_grad,
    require,
)
from .paths import (
    LocalGemm,
    caller_set,
    fused_blocker,
    fused_or_sequential,
    local_product,
)
from .plans import plan_for, signature
from .reduce_details.knobs import (
    MECHANISMS,
    check_partials_knobs,
    check_producer_schedule,
    partials_candidates,
)
from .reduce_details.plan import ReducePlan, build_two_shot, segment, two_shot_fits
from .reduce_details.run import FusedReduce, ReduceOpPlan

OP = "gemm_rs"
REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class GemmRsConfig(GemmKnobs):
    """Every knob of gemm_rs; templates/gemm_rs.toml explains each value."""

    pieces: int = 1  # each owner's rows travel in this many pieces, each with its own flag
    lag: int | None = None  # rounds between producing a piece and reducing it (None: own rows last)
    mechanism: str = PUSH  # or "copy_engine"
    producer: str = "triton"  # or "cublas": torch.matmul computes peers' pieces (own pieces last)
    comm_sms: int = 0  # SMs the GEMM leaves free (copy_engine: >= 1 for the flag waits)
    path: str = "auto"  # "auto" | "fused" | "sequential"
    min_fused_flops: float = (
        1e11  # "auto" below this takes the sequential path (measured: templates/gemm_rs.toml)
    )
    timeout_s: float = DEFAULT_TIMEOUT_S
    allow_tf32: bool = False
    epilogue: str = (
        "tma"  # or "pointer": how tiles are stored and read back (tma falls back where unaligned)
    )

    def validate(self) -> GemmRsConfig:
        check_gemm_knobs(OP, self)
        check_epilogue(OP, self)
        check_partials_knobs(OP, self)
        require(self.comm_sms >= (1 if self.mechanism == COPY_ENGINE else 0), OP,
                f"config: comm_sms must be >= 1 with copy_engine (its flag waits run beside the GEMM), got {self.comm_sms}")  # fmt: skip
        require(
            self.path in ("auto", "fused", "sequential"),
            OP,
            f"config: path must be auto, fused or sequential, got '{self.path}'",
        )
        return self


def gemm_rs(
    x: torch.Tensor,  # [M, K_local]
    w: torch.Tensor,  # [K_local, N]
    group: dist.ProcessGroup | None = None,
    *,
    schedule: ChunkSchedule | None = None,
    config: GemmRsConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [rows of this rank, N]
    reduce_op: str = "sum",
) -> torch.Tensor:
    """``reduce_scatter(x @ w)`` with the reduction overlapped with the GEMM.

    Every rank of ``group`` must call it with the same shapes, dtype and config.
    Returns this rank's rows [r * M // world, (r + 1) * M // world) of the sum.
    Records no gradient (integrations/ does).
    """
    if config is None and schedule is None and reduce_op in REDUCE_OPS:
        product = local_product(OP, group, x, w, out)
        if product is not None:
            return product
    refuse_grad(OP, x, w)
    key = signature(OP, x, w, group, config, schedule, reduce_op)
    plan = plan_for(
        OP,
        key,
        lambda: make_plan(x, w, group, schedule=schedule, config=config, reduce_op=reduce_op),
    )
    return plan(x, w, out)


def running_config(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: GemmRsConfig | dict | None = None,
    reduce_op: str = "sum",
) -> GemmRsConfig:
    """The config a call ``gemm_rs(x, w, group, config=config)`` runs (its plan's:
    made now where the signature has none, a collective as the call is)."""
    key = signature(OP, x, w, group, config, None, reduce_op)
    return plan_for(
        OP, key, lambda: make_plan(x, w, group, schedule=None, config=config, reduce_op=reduce_op)
    ).cfg


def make_plan(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    schedule: ChunkSchedule | None,
    config: GemmRsConfig | dict | None,
    reduce_op: str,
) -> GemmRsPlan:
    """The plan of a call signature: every input check, the config, the path;
    inside ``overlap_kernels.autotune()`` the fastest candidate's."""
    check_gemm_operands(OP, x, w, "x", "w")
    group = check_group(OP, group, x.device)
    require(reduce_op in REDUCE_OPS, OP, f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    shape = shape_key(dist.get_world_size(group), x.shape[0], x.shape[1], w.shape[1], x.dtype)
    cfg = build_config(GemmRsConfig, OP, shape, config, device=x.device)

    def make(changes: dict) -> GemmRsPlan:
        return GemmRsPlan(x, w, group, schedule, dataclasses.replace(cfg, **changes).validate(), reduce_op,
                          forced=caller_set(config, "path"))  # fmt: skip

    plan = make({})
    if shape["world"] == 1:  # nothing to reduce: the op is x @ w (paths.LocalGemm)
        return LocalGemm(OP, plan.cfg, plan.out_shape)
    if schedule is not None or fused_blocker(
        x, w, shape["world"], "reduce", min_rows=shape["world"]
    ):
        return plan
    return autotune.fastest_plan(
        OP, plan, shape=shape, config=config, changes=partials_candidates(cfg, "fused"), make=make,
        x=x, w=w, group=group,
    )  # fmt: skip


class GemmRsPlan(ReduceOpPlan):
    """What a call of one signature runs (ops/plans.py): the plain pair, or the
    fused kernels (which replay in CUDA graphs: ops/replay.py)."""

    op = OP

    def __init__(self, x, w, group, schedule, cfg: GemmRsConfig, reduce_op: str, *, forced: bool):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        start, stop = segment(rank, x.shape[0], world)
        self.group, self.reduce_op, self.out_shape = group, reduce_op, (stop - start, w.shape[1])
        # The plain path's collective (reduce_scatter_rows), chosen once: NCCL's reduce-scatter
        # where the rows split evenly, else an all-reduce whose rows this rank keeps.
        self.evenly, self.reduction = (
            x.shape[0] % world == 0 and is_nccl(group),
            _reduction(reduce_op),
        )
        blocker = fused_blocker(x, w, world, "reduce", min_rows=world)
        cfg = fused_or_sequential(
            OP,
            cfg,
            blocker,
            2.0 * x.shape[0] * x.shape[1] * w.shape[1],
            tuple(x.shape),
            forced=forced,
        )
        if schedule is not None:
            check_producer_schedule(OP, schedule, world, MECHANISMS, cfg)
        self.fused = None
        if cfg.path != "sequential":
            check_tiles_fit(OP, cfg, x.dtype, x.device)
            if schedule is None:
                require(two_shot_fits(world, cfg.pieces, pulled=cfg.mechanism == COPY_ENGINE), OP,
                        f"config: pieces {cfg.pieces} is too many for the flags of {world} ranks")  # fmt: skip
                schedule = rounds_by_config(world, cfg.pieces, cfg.mechanism, cfg.lag)
            cfg = epilogue_for_new_out(OP, cfg, w.shape[1], x.dtype)
            m, n, dtype = x.shape[0], w.shape[1], x.dtype

            def build(ws: Workspace, half: int, cfg: GemmRsConfig = cfg) -> ReducePlan:
                return build_two_shot(ws, schedule, m, n, dtype, cfg, half, publish=False)

            scale = 1.0 / world if reduce_op == "avg" else 1.0
            self.fused = FusedReduce(
                OP, x, w, group, cfg, schedule, build, one_shot=False, scale=scale
            )
        self.cfg = cfg

    def plain(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The plain pair, with as little host work as the caller's own: torch.mm
        (torch.matmul's for two matrices), then NCCL's reduce-scatter, what
        :func:`reduce_scatter_rows` chooses decided once (``self.evenly``)."""
        out = out if out is not None else new_out(self.out_shape, x)
        full = torch.mm(x, w)
        if self.evenly:
            return _scatter_evenly(full, self.group, out, self.reduction, self.cfg.timeout_s)
        return reduce_scatter_rows(full, self.group, out, self.reduce_op, self.cfg.timeout_s)


def reduce_scatter_rows(
    full: torch.Tensor,
    group: dist.ProcessGroup,
    out: torch.Tensor,
    reduce_op: str = "sum",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> torch.Tensor:
    """``out`` = this rank's rows (``segment``) of the sum (or mean) over ranks
    of ``full`` [M, ...]; ``full`` may be overwritten. The plain path's
    collective, bounded by ``timeout_s`` where it can be (runtime/collectives.py)."""
    if _scatters_evenly(full, group):
        return _scatter_evenly(full, group, out, _reduction(reduce_op), timeout_s)
    return start_reduce_scatter_rows(full, group, out, reduce_op, timeout_s)()


def _scatter_evenly(full: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor,
                    reduction: dist.ReduceOp, timeout_s: float) -> torch.Tensor:  # fmt: skip
    """NCCL's reduce-scatter of ``full`` into ``out``, under the plain path's deadline:
    enqueued, ordered after the caller's stream and before its next work (no Work to
    wait for)."""
    collective(OP, "reduce-scatter", reduce_scatter_single, out, full, op=reduction,
               group=group, timeout_s=timeout_s)  # fmt: skip
    return out


def start_reduce_scatter_rows(
    full: torch.Tensor,
    group: dist.ProcessGroup,
    out: torch.Tensor,
    reduce_op: str = "sum",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Callable[[], torch.Tensor]:
    """:func:`reduce_scatter_rows` started: what the caller enqueues next runs
    beside it; the returned ``wait()`` gives ``out`` once it is ready to use."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if _scatters_evenly(full, group):
        scattered = start_collective(OP, "reduce-scatter", reduce_scatter_single, out, full,
                                     op=_reduction(reduce_op), group=group, timeout_s=timeout_s)  # fmt: skip

        def ready() -> torch.Tensor:
            scattered()
            return out

        return ready
    # Uneven slices (or gloo, which has no reduce-scatter): all-reduce, keep ours.
    summed = start_collective(
        OP, "all-reduce", dist.all_reduce, full, group=group, timeout_s=timeout_s
    )

    def rows() -> torch.Tensor:
        summed()
        start, stop = segment(rank, full.shape[0], world)
        out.copy_(full[start:stop])
        return out.div_(world) if reduce_op == "avg" else out

    return rows


def _scatters_evenly(full: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether NCCL's reduce-scatter serves: an NCCL group, and rows that split evenly."""
    return is_nccl(group) and full.shape[0] % dist.get_world_size(group) == 0


def _reduction(reduce_op: str) -> dist.ReduceOp:
    return dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
