"""gemm_ar: matmul then all-reduce, with the reduction hidden inside the GEMM.

Problem
    Each rank holds x [M, K_local] and w [K_local, N] (row-major, or
    ``weight.t()`` of an nn.Linear weight); every rank returns the sum over
    ranks of x @ w, [M, N].

Algorithm, two paths chosen by shape (``running_config`` says which):
    ``two_shot`` (large M: prefill, training). gemm_rs's reduction, then a
        gather: the producer GEMM (kernels/reduce_gemm.py) moves every peer's
        partial to its owner by config ``mechanism`` (gemm_rs.py says how):
        ``push`` in rounds (in round i every rank pushes piece i of every
        peer's rows into that peer's memory and reduces its own piece i
        ``lag`` rounds later) or ``copy_engine`` (owners pull staged partials
        and reduce their own pieces last, whatever ``lag`` says). Config
        ``producer = "cublas"`` (push only) computes peers' rows as gemm_rs's
        does, one torch.matmul per owner into the owner's slot, and our GEMM
        then reduces and publishes the own pieces. With ``copy_engine`` it is
        refused: pulled, it ran slower than our GEMM pulled where it was timed
        (docs/performance.md, "two_shot (large M)"), so a table or autotune()
        would not pick it.
        The owner publishes each reduced piece in its symmetric memory and
        signals every peer; the peers' copy engines pull each published piece
        into ``out`` while the GEMM goes on, on ``gather_streams``
        communication streams (owners dealt to them by distance, so copies
        from different owners can run at once).
        Only the last piece's gather is not hidden.
    ``one_shot`` (small M: decode). Every tile is pushed to every peer as soon
        as it is computed; each rank then sums the tile from every peer's copy.
        One kernel, no communication stream, no multicast: latency is a GEMM
        plus one NVLink round trip.
    ``sequential``: torch.matmul then the NCCL all-reduce (tiny problems,
        layouts TMA cannot read); on one rank torch's x @ w alone (paths.LocalGemm).
    The path, mechanism and producer of a shape come from a tuned table where
    one covers it (tuned.py), else from the template; ``overlap_kernels.autotune()``
    measures them. Checks and choices are made once per call signature
    (ops/plans.py): at decode sizes a call's host time is its time.

Numerics
    Partials travel in the output dtype and are summed in fp32 in rank order;
    every rank gets the same bits. two_shot: each piece is summed once, by its
    owner, with the owner's own partial unrounded. one_shot: every rank sums
    the same rounded partials (its own included) in the same order.

Signal contract
    runtime/signals.py; flag slots in reduce_details/plan.py. Waits are bounded
    by config.timeout_s; a timeout raises OverlapTimeoutError.

Example (run with ``torchrun --nproc-per-node 4 example.py``)::

    import torch, torch.distributed as dist
    from overlap_kernels import gemm_ar
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)        # decode tokens, K slice
    weight = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)  # nn.Linear layout
    out = gemm_ar(x, weight.t(), dist.group.WORLD)                         # [64, 8192] on every rank
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..limits import DEFAULT_TIMEOUT_S
from ..runtime.collectives import collective
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
    refuse_grad,
    require,
)
from .paths import LocalGemm, caller_set, fused_blocker, local_product
from .plans import plan_for, signature
from .reduce_details.knobs import check_partials_knobs, check_producer_schedule, partials_candidates
from .reduce_details.plan import (
    CUBLAS,
    TRITON,
    ReducePlan,
    build_one_shot,
    build_two_shot,
    one_shot_fits,
    two_shot_fits,
)
from .reduce_details.run import FusedReduce, ReduceOpPlan

OP = "gemm_ar"
PATHS = ("auto", "one_shot", "two_shot", "sequential")
# Calls captured in a CUDA graph: the path as configured ("same"), or the plain pair,
# which a replay runs without its host cost (the tuned tables say where it replays faster).
GRAPH_PATHS = ("same", "sequential")
PRODUCERS = (TRITON, CUBLAS)
PULL_PRODUCERS = (TRITON,)  # the cuBLAS producer pushes only here (module docstring: why)
DECODE_CANDIDATES = ({"path": "one_shot"}, {"path": "sequential"})
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmArConfig(GemmKnobs):
    """Every knob of gemm_ar; templates/gemm_ar.toml explains each value."""

    pieces: int = 4  # two_shot: each rank's rows are reduced and gathered in this many pieces
    lag: int | None = (
        1  # two_shot, push only: rounds between pushing a piece and reducing it (None: own rows last)
    )
    mechanism: str = PUSH  # two_shot: or "copy_engine"
    producer: str = (
        TRITON  # or "cublas" (push only): torch.matmul computes peers' pieces (own pieces last)
    )
    comm_sms: int = 1  # SMs the GEMM leaves free (two_shot: >= 1 for the gather's flag waits)
    gather_streams: int = (
        1  # two_shot: communication streams the gathers of published sums are dealt to, by owner
    )
    path: str = "auto"
    one_shot_max_m: int = (
        64  # "auto" takes one_shot up to this M (measured: templates/gemm_ar.toml)
    )
    min_fused_flops: float = (
        5e11  # above one_shot_max_m, "auto" below this takes the sequential path
    )
    timeout_s: float = DEFAULT_TIMEOUT_S
    allow_tf32: bool = False
    epilogue: str = (
        "tma"  # or "pointer": how tiles are stored and read back (tma falls back where unaligned)
    )
    graph_path: str = "same"  # or "sequential": the plain pair while a CUDA graph is captured

    def validate(self) -> GemmArConfig:
        check_gemm_knobs(OP, self)
        check_epilogue(OP, self)
        # Before the shared checks: their lag rule would otherwise be the first complaint here.
        require(not (self.producer == CUBLAS and self.mechanism == COPY_ENGINE), OP,
                f"config: producer '{self.producer}' pushes partials only (mechanism push), got copy_engine")  # fmt: skip
        check_partials_knobs(OP, self, producers=PRODUCERS, lag_with_pulls=False)
        require(self.comm_sms >= 0, OP, f"config: comm_sms must be >= 0, got {self.comm_sms}")
        require(
            self.gather_streams >= 1,
            OP,
            f"config: gather_streams must be >= 1, got {self.gather_streams}",
        )
        require(
            self.path in PATHS,
            OP,
            f"config: path must be one of {', '.join(PATHS)}, got '{self.path}'",
        )
        require(
            self.graph_path in GRAPH_PATHS,
            OP,
            f"config: graph_path must be one of {', '.join(GRAPH_PATHS)}, got '{self.graph_path}'",
        )
        return self


def gemm_ar(
    x: torch.Tensor,  # [M, K_local]
    w: torch.Tensor,  # [K_local, N]
    group: dist.ProcessGroup | None = None,
    *,
    schedule: ChunkSchedule | None = None,
    config: GemmArConfig | dict | None = None,
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``all_reduce(x @ w)`` with the reduction overlapped with the GEMM.

    Every rank of ``group`` must call it with the same shapes, dtype and config.
    ``schedule`` (a producer schedule whose partials are pushed or pulled by
    the copy engine) is used by the two_shot path. Records no gradient (integrations/ does).
    """
    if config is None and schedule is None:
        product = local_product(OP, group, x, w, out)
        if product is not None:
            return product
    refuse_grad(OP, x, w)
    key = signature(OP, x, w, group, config, schedule)
    plan = plan_for(OP, key, lambda: make_plan(x, w, group, schedule=schedule, config=config))
    return plan(x, w, out)


def running_config(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    config: GemmArConfig | dict | None = None,
) -> GemmArConfig:
    """The config a call ``gemm_ar(x, w, group, config=config)`` runs (its plan's:
    made now where the signature has none, a collective as the call is)."""
    key = signature(OP, x, w, group, config, None)
    return plan_for(OP, key, lambda: make_plan(x, w, group, schedule=None, config=config)).cfg


def make_plan(
    x: torch.Tensor,
    w: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    schedule: ChunkSchedule | None,
    config: GemmArConfig | dict | None,
) -> GemmArPlan:
    """The plan of a call signature: every input check, the config, the path;
    inside ``overlap_kernels.autotune()`` the fastest candidate's."""
    check_gemm_operands(OP, x, w, "x", "w")
    group = check_group(OP, group, x.device)
    shape = shape_key(dist.get_world_size(group), x.shape[0], x.shape[1], w.shape[1], x.dtype)
    cfg = build_config(GemmArConfig, OP, shape, config, device=x.device)

    def make(changes: dict) -> GemmArPlan:
        return GemmArPlan(x, w, group, schedule, dataclasses.replace(cfg, **changes).validate(),
                          forced=caller_set(config, "path"))  # fmt: skip

    plan = make({})
    if shape["world"] == 1:  # nothing to reduce: the op is x @ w (paths.LocalGemm)
        return LocalGemm(OP, plan.cfg, plan.out_shape)
    if schedule is not None or fused_blocker(x, w, shape["world"], "reduce"):
        return plan
    changes = autotune_changes(x.shape[0], w.shape[1], shape["world"], cfg)
    return autotune.fastest_plan(
        OP, plan, shape=shape, config=config, changes=changes, make=make,
        x=x, w=w, group=group,
    )  # fmt: skip


def autotune_changes(m: int, n: int, world: int, cfg: GemmArConfig) -> tuple[dict, ...]:
    """What ``overlap_kernels.autotune()`` measures for an M x N output: one_shot and
    the pair up to one_shot_max_m where one_shot's flags fit; else two_shot's
    candidates, the pair, and one_shot where its flags fit, since it can still win
    where few ranks send (x2 at M = 256: templates/gemm_ar.toml)."""
    fits = one_shot_fits(m, n, world, cfg)
    if fits and m <= cfg.one_shot_max_m:
        return DECODE_CANDIDATES
    two_shot = partials_candidates(cfg, "two_shot", PRODUCERS, PULL_PRODUCERS)
    return two_shot + (DECODE_CANDIDATES[:1] if fits else ())


def resolve_path(
    x: torch.Tensor,
    w: torch.Tensor,
    world: int,
    cfg: GemmArConfig,
    *,
    has_schedule: bool,
    forced: bool,
) -> tuple[str, str | None]:
    """(path, why not fused) from shapes only, so every rank decides alike.
    Decode sizes (M <= one_shot_max_m) take one_shot, which beats the pair there
    however few FLOP the GEMM has; other calls (a schedule given, say) take
    two_shot where the product is large enough to hide the exchange. A path the
    caller ``forced`` that cannot run is an input error; one a table asked for gives way."""
    m, n = x.shape[0], w.shape[1]
    blocker = fused_blocker(x, w, world, "reduce")
    one_shot_blocker = (
        None if one_shot_fits(m, n, world, cfg) else "too many tiles for one flag each"
    )
    if has_schedule:
        one_shot_blocker = "a schedule was given: one_shot has none"
    two_shot_blocker = None if m >= world else f"M = {m} < {world} ranks: some rank owns no rows"
    if not two_shot_fits(world, cfg.pieces, pulled=cfg.mechanism == COPY_ENGINE):
        two_shot_blocker = f"pieces {cfg.pieces} is too many for the flags of {world} ranks"
    if cfg.comm_sms < 1:
        two_shot_blocker = "two_shot needs comm_sms >= 1 (its gather waits run beside the GEMM)"
    if cfg.path == "sequential":
        return "sequential", None
    if cfg.path != "auto":
        why = blocker or (one_shot_blocker if cfg.path == "one_shot" else two_shot_blocker)
        require(
            why is None or not forced, OP, f"path='{cfg.path}' cannot run: {why}; use path='auto'"
        )
        if why is None:
            return cfg.path, None
    if m <= cfg.one_shot_max_m and one_shot_blocker is None:
        return ("one_shot", None) if blocker is None else ("sequential", blocker)
    flops = 2.0 * m * x.shape[1] * n
    small = (
        None
        if flops >= cfg.min_fused_flops
        else f"{flops:.3g} FLOP < min_fused_flops {cfg.min_fused_flops:.3g}"
    )
    why = blocker or small or two_shot_blocker
    return ("two_shot", None) if why is None else ("sequential", why)


class GemmArPlan(ReduceOpPlan):
    """What a call of one signature runs (ops/plans.py): the plain pair, one_shot
    or two_shot; both fused paths replay in CUDA graphs (ops/replay.py)."""

    op = OP

    def __init__(self, x, w, group, schedule, cfg: GemmArConfig, *, forced: bool):
        world = dist.get_world_size(group)
        path, why = resolve_path(x, w, world, cfg, has_schedule=schedule is not None, forced=forced)
        if why is not None:
            _log.info("gemm_ar %s: sequential path (%s)", tuple(x.shape), why)
        cfg = dataclasses.replace(cfg, path=path)
        if schedule is not None:
            check_producer_schedule(OP, schedule, world, (PUSH, COPY_ENGINE), cfg)
            require(cfg.producer != CUBLAS or COPY_ENGINE not in schedule.mechanisms, OP,
                    f"config producer '{cfg.producer}' pushes partials only: the schedule pulls them (copy_engine)")  # fmt: skip
        self.group, self.out_shape, self.fused = group, (x.shape[0], w.shape[1]), None
        self.plain_when_captured = cfg.graph_path == "sequential"
        if path != "sequential":
            check_tiles_fit(OP, cfg, x.dtype, x.device)
            cfg = epilogue_for_new_out(OP, cfg, w.shape[1], x.dtype)
            one_shot = path == "one_shot"
            if not one_shot:
                lag = cfg.lag if cfg.mechanism == PUSH else None  # pulled partials: own pieces last
                schedule = schedule or rounds_by_config(world, cfg.pieces, cfg.mechanism, lag)
            m, n, dtype = x.shape[0], w.shape[1], x.dtype

            def build(
                ws: Workspace, half: int, cfg: GemmArConfig = cfg
            ) -> ReducePlan:  # (shapes, never tensors: the plan keeps it)
                if one_shot:
                    return build_one_shot(ws, m, n, dtype, cfg, half)
                return build_two_shot(ws, schedule, m, n, dtype, cfg, half, publish=True)

            self.fused = FusedReduce(OP, x, w, group, cfg, schedule, build, one_shot=one_shot)
        self.cfg = cfg

    def plain(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The plain pair, with as little host work as the caller's own: torch.mm
        (torch.matmul's for two matrices, one dispatch less), then NCCL's all-reduce."""
        out = torch.mm(x, w, out=out) if out is not None else torch.mm(x, w)
        collective(OP, "all-reduce", dist.all_reduce, out, group=self.group,
                   timeout_s=self.cfg.timeout_s)  # fmt: skip
        return out
