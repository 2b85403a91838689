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
    ``fastest`` (the template's choice on CUDA) times push and copy_engine (each
    with both producers) and the plain path on the first call of a shape and keeps
    the fastest; where that is fused, all are timed again in place on the calls
    that follow (ops/fastest.py): the copy engine's speed differs between hosts.
    The tile that completes a piece signals the owner. The owner computes its
    own rows last; each of those tiles waits for every peer's partial, adds
    them to its fp32 accumulator in rank order and stores the sum.
    Small problems (config.min_fused_flops), world size 1 and layouts TMA cannot
    read take the plain path: torch.matmul, then the NCCL reduce-scatter.

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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.collectives import reduce_scatter_single
from ..schedules import COPY_ENGINE, PUSH, ChunkSchedule
from ..schedules.producers import own_pieces_last, producer_problems, rounds_by_config
from ..tuning import build_config, memoized_for_default_config, shape_key
from .checks import (
    GemmKnobs,
    check_current_device,
    check_epilogue,
    check_gemm_knobs,
    check_gemm_operands,
    check_group,
    is_nccl,
    check_out,
    check_tiles_fit,
    checked_once_per_signature,
    operands_signature,
    require,
    resolve_epilogue,
    tma_aligned,
)
from .fastest import fastest_config, timed_in_place
from .paths import fused_blocker, fused_or_sequential, plain_while_capturing
from .reduce_details.plan import CUBLAS, TRITON, build_two_shot, segment, two_shot_fits
from .reduce_details.run import fused_call

OP = "gemm_rs"
MECHANISMS = (PUSH, COPY_ENGINE)
FASTEST = "fastest"  # mechanism: push, copy_engine or the plain path, whichever measures fastest
REDUCE_OPS = ("sum", "avg")
PRODUCERS = (TRITON, CUBLAS)


@dataclass(frozen=True)
class GemmRsConfig(GemmKnobs):
    """Every knob of gemm_rs; templates/gemm_rs.toml explains each value."""

    pieces: int = 1  # each owner's rows travel in this many pieces, each with its own flag
    lag: int | None = None  # rounds between producing a piece and reducing it (None: own rows last)
    mechanism: str = PUSH  # or "copy_engine", or "fastest" (measured on the first call of a shape)
    producer: str = TRITON  # or "cublas": torch.matmul computes peers' pieces (own pieces last)
    comm_sms: int = 0  # SMs the GEMM leaves free (copy_engine: >= 1 for the flag waits)
    path: str = "auto"  # "auto" | "fused" | "sequential"
    min_fused_flops: float = 1e11  # "auto" below this takes the sequential path (measured: templates/gemm_rs.toml)
    timeout_s: float = 30.0
    allow_tf32: bool = False
    epilogue: str = "tma"  # or "pointer": how tiles are stored and read back (tma falls back where unaligned)

    def validate(self) -> GemmRsConfig:
        check_gemm_knobs(OP, self)
        check_epilogue(OP, self)
        check_partials_knobs(OP, self)
        require(self.comm_sms >= (1 if self.mechanism == COPY_ENGINE else 0), OP,
                f"config: comm_sms must be >= 1 with copy_engine (its flag waits run beside the GEMM), got {self.comm_sms}")  # fmt: skip
        require(self.path in ("auto", "fused", "sequential"), OP, f"config: path must be auto, fused or sequential, got '{self.path}'")
        return self


def check_partials_knobs(op: str, cfg, *, producers: tuple[str, ...] = PRODUCERS, lag_with_pulls: bool = True) -> None:
    """The knobs gemm_rs and gemm_ar's two_shot path share: how partials move
    (``mechanism``), what computes peers' pieces (``producer``, one of the op's
    ``producers``), when own pieces are reduced (``lag``; ``lag_with_pulls=False``:
    an op that ignores it for pulled partials, which are always reduced last)."""
    require(cfg.mechanism in (*MECHANISMS, FASTEST), op,
            f"config: mechanism must be push, copy_engine or fastest, got '{cfg.mechanism}'")  # fmt: skip
    require(cfg.producer in producers, op, f"config: producer must be {' or '.join(producers)}, got '{cfg.producer}'")
    require(cfg.producer != CUBLAS or cfg.lag is None or cfg.lag >= cfg.pieces, op,
            f"config: producer 'cublas' computes every peer's piece before our GEMM runs the own rows: lag None or >= pieces, got lag {cfg.lag}")  # fmt: skip
    require(cfg.lag is None or cfg.lag >= 1, op, f"config: lag must be None or >= 1, got {cfg.lag}")
    require(not lag_with_pulls or cfg.mechanism != COPY_ENGINE or cfg.lag is None or cfg.lag >= cfg.pieces, op,
            f"config: copy_engine pulls need every rank's own pieces last: lag None or >= pieces, got lag {cfg.lag}")  # fmt: skip


def measured_candidates(
    cfg, producers: tuple[str, ...] = PRODUCERS, pull_producers: tuple[str, ...] = PRODUCERS
) -> tuple[dict, ...]:
    """What ``mechanism = "fastest"`` times (the changes to ``cfg``): push with
    every one of ``producers``, the copy engine with every one of
    ``pull_producers`` (its own pieces last and an SM left for the flag waits),
    and the plain path. cuBLAS reduces its own pieces last too (lag None)."""
    pushed = ({"mechanism": PUSH, "producer": p} | ({"lag": None} if p == CUBLAS else {}) for p in producers)
    pulled = {"mechanism": COPY_ENGINE, "comm_sms": max(1, cfg.comm_sms), "lag": None}
    return (*pushed, *({**pulled, "producer": p} for p in pull_producers), {"path": "sequential"})


@memoized_for_default_config
def resolve_config(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None, config=None) -> GemmRsConfig:
    """The config a call with these arguments uses, ``path`` resolved to fused or sequential."""
    world = dist.get_world_size(group)
    cfg = build_config(GemmRsConfig, OP, shape_key(world, x.shape[0], x.shape[1], w.shape[1], x.dtype), config)
    blocker = fused_blocker(x, w, world, "reduce", min_rows=world)
    return fused_or_sequential(OP, cfg, blocker, 2.0 * x.shape[0] * x.shape[1] * w.shape[1], tuple(x.shape))


def check_producer_schedule(op: str, schedule: ChunkSchedule, world: int, mechanisms: tuple[str, ...], cfg) -> None:
    """A user's producer schedule, checked against the op and the call's config."""
    require(isinstance(schedule, ChunkSchedule), op, "schedule must be a ChunkSchedule")
    require(schedule.world_size == world, op, f"schedule is for {schedule.world_size} ranks, group has {world}")
    problems = producer_problems(schedule)
    require(not problems, op, f"schedule '{schedule.name}' is invalid:\n  " + "\n  ".join(problems))
    used = schedule.mechanisms
    require(used <= set(mechanisms), op,
            f"schedule uses {sorted(used - set(mechanisms))}; {op} moves partials by {', '.join(mechanisms)}")  # fmt: skip
    require(len(used) <= 1, op, f"schedule mixes {sorted(used)}: a reduction waits on one kind of flag, "
            "so every partial must move by the same mechanism")  # fmt: skip
    pieces = schedule.for_rank(0)[0].pieces
    require(two_shot_fits(world, pieces, pulled=COPY_ENGINE in used), op,
            f"schedule has {pieces} pieces: too many for the flags of {world} ranks")  # fmt: skip
    require(cfg.producer != CUBLAS or own_pieces_last(schedule), op,
            "config producer 'cublas' computes every peer's piece before our GEMM runs the own rows: "
            "the schedule must put every rank's own pieces last")  # fmt: skip
    if COPY_ENGINE in used:
        require(own_pieces_last(schedule), op,
                "a schedule whose partials are pulled (copy_engine) must put every rank's own pieces last")  # fmt: skip
        require(cfg.comm_sms >= 1, op, "a schedule with copy_engine pulls needs config comm_sms >= 1 "
                "(their flag waits run beside the GEMM)")  # fmt: skip


@checked_once_per_signature
def _checked(x, w, group, *, schedule, config, out, reduce_op) -> tuple[dist.ProcessGroup, GemmRsConfig]:
    """Every input check of a call, before anything launches; the group and the config."""
    check_gemm_operands(OP, x, w, "x", "w")
    group = check_group(OP, group, x.device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    require(reduce_op in REDUCE_OPS, OP, f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    start, stop = segment(rank, x.shape[0], world)
    check_out(OP, out, (stop - start, w.shape[1]), x, x, w)
    cfg = resolve_config(x, w, group, config)
    if schedule is not None:
        check_producer_schedule(OP, schedule, world, MECHANISMS, cfg)
    if cfg.path != "sequential":
        check_tiles_fit(OP, cfg, x.dtype, x.device)
        if schedule is None:
            require(two_shot_fits(world, cfg.pieces, pulled=cfg.mechanism == COPY_ENGINE), OP,
                    f"config: pieces {cfg.pieces} is too many for the flags of {world} ranks")  # fmt: skip
    return group, cfg


@timed_in_place(OP)
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
    """
    group, cfg = _checked(x, w, group, schedule=schedule, config=config, out=out, reduce_op=reduce_op)
    cfg = plain_while_capturing(OP, cfg, x.device)
    if schedule is None:  # a schedule names its own mechanism
        cfg = _measured_if_asked(x, w, group, cfg, reduce_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    start, stop = segment(rank, x.shape[0], world)
    shape = (stop - start, w.shape[1])
    if cfg.path != "sequential":
        check_current_device(OP, x)
    out = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if cfg.path != "sequential":
        cfg = resolve_epilogue(OP, cfg, out, w.shape[1])
    if cfg.path == "sequential":
        return _sequential(x, w, group, out, reduce_op)
    if schedule is None:
        schedule = rounds_by_config(world, cfg.pieces, cfg.mechanism, cfg.lag)
    scale = 1.0 / world if reduce_op == "avg" else 1.0
    x, w = tma_aligned(x), tma_aligned(w)
    m, n = x.shape[0], w.shape[1]

    def build(ws, half):
        return build_two_shot(ws, schedule, m, n, x.dtype, cfg, half, publish=False)

    fused_call(OP, x, w, group, cfg, out, schedule, build, one_shot=False, scale=scale)
    return out


def running_config(
    x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None, config=None, reduce_op: str = "sum"
) -> GemmRsConfig:
    """The config a call ``gemm_rs(x, w, group, config=config)`` runs: resolve_config's,
    with a ``fastest`` mechanism measured (a collective the first time, as the call is)."""
    group, cfg = _checked(x, w, group, schedule=None, config=config, out=None, reduce_op=reduce_op)
    return _measured_if_asked(x, w, group, cfg, reduce_op)


def _measured_if_asked(x, w, group, cfg: GemmRsConfig, reduce_op: str) -> GemmRsConfig:
    """``cfg``, or where its mechanism is ``fastest`` (fused path), the fastest of
    push and copy_engine (Triton or cuBLAS producer) and the plain path for this call's signature."""
    if cfg.mechanism != FASTEST or cfg.path != "fused":
        return cfg
    key = (OP, *operands_signature(x, w, group), cfg, reduce_op)
    return fastest_config(
        OP, key, cfg, measured_candidates(cfg),
        check=lambda c: _checked(x, w, group, schedule=None, config=c, out=None, reduce_op=reduce_op),
        run=lambda c: gemm_rs(x, w, group, config=c, reduce_op=reduce_op),
        group=group, device=x.device,
    )  # fmt: skip


def _sequential(x, w, group, out, reduce_op: str) -> torch.Tensor:
    return reduce_scatter_rows(torch.matmul(x, w), group, out, reduce_op)


def reduce_scatter_rows(full: torch.Tensor, group, out: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
    """``out`` = this rank's rows (``segment``) of the sum (or mean) over ranks
    of ``full`` [M, ...]; ``full`` may be overwritten. The plain path's collective."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if is_nccl(group) and full.shape[0] % world == 0:
        op = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
        reduce_scatter_single(out, full, op=op, group=group)
        return out
    # Uneven slices (or gloo, which has no reduce-scatter): all-reduce, keep ours.
    dist.all_reduce(full, group=group)
    start, stop = segment(rank, full.shape[0], world)
    out.copy_(full[start:stop])
    return out.div_(world) if reduce_op == "avg" else out


