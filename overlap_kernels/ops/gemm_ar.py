"""gemm_ar: matmul then all-reduce, with the reduction hidden inside the GEMM.

Problem
    Each rank holds x [M, K_local] and w [K_local, N] (row-major, or
    ``weight.t()`` of an nn.Linear weight); every rank returns the sum over
    ranks of x @ w, [M, N].

Algorithm, two paths chosen by shape (``resolve_config`` says which):
    ``two_shot`` (large M: prefill, training). gemm_rs's reduction, then a
        gather: the producer GEMM (kernels/reduce_gemm.py) moves every peer's
        partial to its owner by config ``mechanism`` (gemm_rs.py says how):
        ``push`` in rounds (in round i every rank pushes piece i of every
        peer's rows into that peer's memory and reduces its own piece i
        ``lag`` rounds later) or ``copy_engine`` (owners pull staged partials
        and reduce their own pieces last, whatever ``lag`` says). Config
        ``producer = "cublas"`` (push only) computes peers' rows as gemm_rs's
        does, one torch.matmul per owner into the owner's slot, and our GEMM
        then reduces and publishes the own pieces. Pulled, that producer never
        beat our GEMM here and timed out in the back-to-back GPU test, most
        likely by the mid-call kernel load that run.py's load_modules now
        prevents (not re-run: bench/NOTES.md), so it is not offered.
        The owner publishes each reduced piece in its symmetric memory and
        signals every peer; the peers' copy engines pull each published piece
        into ``out`` while the GEMM goes on, on ``gather_streams``
        communication streams (owners dealt to them by distance, so copies
        from different owners can run at once).
        Only the last piece's gather is not hidden. ``mechanism = "fastest"``
        (the template's choice on CUDA) times push (both producers),
        copy_engine and the plain path on the first call of a shape and keeps
        the fastest; where that is fused, all are timed again in place on
        the calls that follow (ops/fastest.py).
    ``one_shot`` (small M: decode). Every tile is pushed to every peer as soon
        as it is computed; each rank then sums the tile from every peer's copy.
        One kernel, no communication stream, no multicast: latency is a GEMM
        plus one NVLink round trip. With ``decode = "fastest"`` (the
        template's choice on CUDA) the first call of a shape times one_shot
        against the plain pair and keeps the faster, and both are timed again
        in place on the calls that follow, whichever was kept: the first
        call's timing sees device time only (ops/fastest.py, ``settle_plain``).
    ``sequential``: torch.matmul then the NCCL all-reduce (world size 1, tiny
        problems, layouts TMA cannot read).
    A call that repeats an earlier call's signature (no ``out``, no schedule)
    skips the checks, the config and the choice and runs the path that call
    ran (ops/repeats.py): at decode sizes a call's host time is its time.

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
import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedules import COPY_ENGINE, PUSH, ChunkSchedule
from ..schedules.producers import rounds_by_config
from ..tuning import build_config, memoized_for_default_config, shape_key
from .checks import (
    GemmKnobs,
    check_current_device,
    check_epilogue,
    check_gemm_knobs,
    check_gemm_operands,
    check_group,
    check_out,
    check_tiles_fit,
    checked_once_per_signature,
    operands_signature,
    require,
    resolve_epilogue,
    tma_aligned,
)
from .fastest import fastest_config, timed_in_place, timing_in_place
from .gemm_rs import (
    FASTEST,
    check_partials_knobs,
    check_producer_schedule,
    measured_candidates,
)
from .paths import capturing, fused_blocker, plain_while_capturing
from .reduce_details.plan import (
    CUBLAS,
    TRITON,
    build_one_shot,
    build_two_shot,
    one_shot_fits,
    two_shot_fits,
)
from .reduce_details.run import FusedRepeat, fused_call
from .repeats import Repeats

OP = "gemm_ar"
PATHS = ("auto", "one_shot", "two_shot", "sequential")
DECODE = ("one_shot", FASTEST)  # what "auto" runs up to one_shot_max_m
PRODUCERS = (TRITON, CUBLAS)
PULL_PRODUCERS = (TRITON,)  # the cuBLAS producer pushes only here (module docstring: why)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmArConfig(GemmKnobs):
    """Every knob of gemm_ar; templates/gemm_ar.toml explains each value."""

    pieces: int = 4  # two_shot: each rank's rows are reduced and gathered in this many pieces
    lag: int | None = 1  # two_shot, push only: rounds between pushing a piece and reducing it (None: own rows last)
    mechanism: str = PUSH  # two_shot: or "copy_engine", or "fastest" (measured on the first call of a shape)
    producer: str = TRITON  # or "cublas" (push only): torch.matmul computes peers' pieces (own pieces last)
    comm_sms: int = 1  # SMs the GEMM leaves free (two_shot: >= 1 for the gather's flag waits)
    gather_streams: int = 1  # two_shot: communication streams the gathers of published sums are dealt to, by owner
    path: str = "auto"
    one_shot_max_m: int = 64  # "auto" takes one_shot up to this M (measured: templates/gemm_ar.toml)
    decode: str = "one_shot"  # up to one_shot_max_m "auto" runs one_shot, or "fastest": one_shot or the pair, measured
    min_fused_flops: float = 5e11  # above one_shot_max_m, "auto" below this takes the sequential path
    min_unmeasured_flops: float = 5e11  # the same for a named mechanism (not "fastest", which times the pair too)
    timeout_s: float = 30.0
    allow_tf32: bool = False
    epilogue: str = "tma"  # or "pointer": how tiles are stored and read back (tma falls back where unaligned)

    def validate(self) -> GemmArConfig:
        check_gemm_knobs(OP, self)
        check_epilogue(OP, self)
        # Before the shared checks: their lag rule would otherwise be the first complaint here.
        require(not (self.producer == CUBLAS and self.mechanism == COPY_ENGINE), OP,
                f"config: producer '{self.producer}' pushes partials only (mechanism push or fastest), got copy_engine")  # fmt: skip
        check_partials_knobs(OP, self, producers=PRODUCERS, lag_with_pulls=False)
        require(self.comm_sms >= 0, OP, f"config: comm_sms must be >= 0, got {self.comm_sms}")
        require(self.gather_streams >= 1, OP, f"config: gather_streams must be >= 1, got {self.gather_streams}")
        require(self.path in PATHS, OP, f"config: path must be one of {', '.join(PATHS)}, got '{self.path}'")
        require(self.decode in DECODE, OP, f"config: decode must be one_shot or fastest, got '{self.decode}'")
        return self


@memoized_for_default_config
def resolve_config(
    x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None, config=None, *, has_schedule: bool = False
) -> GemmArConfig:
    """The config a call with these arguments uses, ``path`` resolved to one_shot,
    two_shot or sequential (from shapes only: every rank decides alike), or
    left "auto" where the first call of the shape times one_shot against the
    plain pair (``decode = "fastest"``). A call with a schedule takes two_shot,
    the path that has one."""
    world = dist.get_world_size(group)
    m, n = x.shape[0], w.shape[1]
    cfg = build_config(GemmArConfig, OP, shape_key(world, m, x.shape[1], n, x.dtype), config)
    blocker = fused_blocker(x, w, world, "reduce")
    one_shot_blocker = None if one_shot_fits(m, n, world, cfg) else "too many tiles for one flag each"
    if has_schedule:
        one_shot_blocker = "a schedule was given: one_shot has none"
    two_shot_blocker = None if m >= world else f"M = {m} < {world} ranks: some rank owns no rows"
    if not two_shot_fits(world, cfg.pieces, pulled=cfg.mechanism == COPY_ENGINE):
        two_shot_blocker = f"pieces {cfg.pieces} is too many for the flags of {world} ranks"
    if cfg.comm_sms < 1:
        two_shot_blocker = "two_shot needs comm_sms >= 1 (its gather waits run beside the GEMM)"
    if cfg.path == "sequential":
        return cfg
    if cfg.path != "auto":
        why = blocker or (one_shot_blocker if cfg.path == "one_shot" else two_shot_blocker)
        require(why is None, OP, f"path='{cfg.path}' cannot run: {why}; use path='auto'")
        return cfg
    # Decode sizes (M <= one_shot_max_m) take one_shot, which beats the pair
    # there however few FLOP the GEMM has; other calls (a schedule given, say)
    # take two_shot where the product is large enough to hide the exchange.
    flops = 2.0 * m * x.shape[1] * n
    if m <= cfg.one_shot_max_m and one_shot_blocker is None:
        path, why = "one_shot", blocker
        if why is None and cfg.decode == FASTEST:
            return cfg  # _measured_if_asked times one_shot against the pair
    else:
        # Without the first call's timing, which weighs the plain pair too,
        # only problems that measured faster fused take two_shot.
        knob = "min_fused_flops" if cfg.mechanism == FASTEST else "min_unmeasured_flops"
        least = getattr(cfg, knob)
        small = None if flops >= least else f"{flops:.3g} FLOP < {knob} {least:.3g}"
        path, why = "two_shot", blocker or small or two_shot_blocker
    if why is not None:
        _log.info("gemm_ar %s: sequential path (%s)", tuple(x.shape), why)
        path = "sequential"
    return dataclasses.replace(cfg, path=path)


@checked_once_per_signature
def _checked(x, w, group, *, schedule, config, out) -> tuple[dist.ProcessGroup, GemmArConfig]:
    """Every input check of a call, before anything launches; the group and the config."""
    check_gemm_operands(OP, x, w, "x", "w")
    group = check_group(OP, group, x.device)
    world = dist.get_world_size(group)
    check_out(OP, out, (x.shape[0], w.shape[1]), x, x, w)
    cfg = resolve_config(x, w, group, config, has_schedule=schedule is not None)
    if schedule is not None:
        check_producer_schedule(OP, schedule, world, (PUSH, COPY_ENGINE), cfg)
        require(cfg.producer != CUBLAS or COPY_ENGINE not in schedule.mechanisms, OP,
                f"config producer '{cfg.producer}' pushes partials only: the schedule pulls them (copy_engine)")  # fmt: skip
    if cfg.path != "sequential":
        check_tiles_fit(OP, cfg, x.dtype, x.device)
    return group, cfg


_repeats = Repeats()  # the signatures' repeats (ops/repeats.py)


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
    the copy engine) is used by the two_shot path. A call that repeats an
    earlier call's signature with no ``out`` or schedule goes straight to the
    path that call ran (ops/repeats.py).
    """
    key = _repeats.key(x, w, group, config) if schedule is None and out is None else None
    repeat = _repeats.get(key)
    if repeat is not None:
        result = repeat(x, w)
        if result is not None:
            return result
    return _gemm_ar(x, w, group, schedule=schedule, config=config, out=out, repeat_key=key)


@timed_in_place(OP)
def _gemm_ar(x, w, group, *, schedule, config, out, repeat_key) -> torch.Tensor:
    """gemm_ar's full path: checks, config, choice, then the path; where that
    path is the signature's answer, it is kept as the signature's repeat."""
    group, cfg = _checked(x, w, group, schedule=schedule, config=config, out=out)
    cfg = plain_while_capturing(OP, cfg, x.device)
    if schedule is None:  # a schedule names its own mechanism
        cfg = _measured_if_asked(x, w, group, cfg)
    keep_as = repeat_key if not capturing(x.device) else None  # where this call's path is kept as a repeat
    if timing_in_place(OP):
        # A candidate timed in place runs as its repeats run: the first call's
        # measurement left one for each (its calls pass the candidate as config),
        # or this call leaves it.
        keep_as = _repeats.key(x, w, group, cfg) if out is None else None
        repeat = _repeats.get(keep_as)
        result = repeat(x, w) if repeat is not None else None
        if result is not None:
            return result
    if cfg.path == "sequential":
        _repeats.keep(keep_as, functools.partial(_plain, group=group))
        return _plain(x, w, group, out)
    check_current_device(OP, x)
    out = out if out is not None else torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    cfg = resolve_epilogue(OP, cfg, out, w.shape[1])
    if cfg.path == "two_shot":
        lag = cfg.lag if cfg.mechanism == PUSH else None  # pulled partials: own pieces last
        schedule = schedule or rounds_by_config(dist.get_world_size(group), cfg.pieces, cfg.mechanism, lag)
    x, w = tma_aligned(x), tma_aligned(w)
    m, n, dtype, one_shot = x.shape[0], w.shape[1], x.dtype, cfg.path == "one_shot"

    def build(ws, half):  # (shapes, never tensors: a repeat keeps it)
        if one_shot:
            return build_one_shot(ws, m, n, dtype, cfg, half)
        return build_two_shot(ws, schedule, m, n, dtype, cfg, half, publish=True)

    fused_call(OP, x, w, group, cfg, out, schedule, build, one_shot=one_shot)
    if keep_as is not None:
        _repeats.keep(keep_as, FusedRepeat(OP, x, w, group, cfg, schedule, build, one_shot=one_shot))
    return out


def _plain(x: torch.Tensor, w: torch.Tensor, group, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain pair, with as little host work as the caller's own."""
    out = torch.matmul(x, w, out=out) if out is not None else torch.matmul(x, w)
    dist.all_reduce(out, group=group)
    return out


def running_config(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup | None = None, config=None) -> GemmArConfig:
    """The config a call ``gemm_ar(x, w, group, config=config)`` runs: resolve_config's,
    with a ``fastest`` mechanism measured (a collective the first time, as the call is)."""
    group, cfg = _checked(x, w, group, schedule=None, config=config, out=None)
    return _measured_if_asked(x, w, group, cfg)


def _measured_if_asked(x, w, group, cfg: GemmArConfig) -> GemmArConfig:
    """``cfg``, or where two_shot's mechanism is ``fastest``, the fastest of push,
    copy_engine and the plain path for this call's signature; where "auto" was
    left to the measurement (decode sizes), the faster of one_shot and the pair."""
    if cfg.path == "auto":
        candidates = ({"path": "one_shot"}, {"path": "sequential"})
    elif cfg.mechanism == FASTEST and cfg.path == "two_shot":
        candidates = measured_candidates(cfg, producers=PRODUCERS, pull_producers=PULL_PRODUCERS)
    else:
        return cfg
    key = (OP, *operands_signature(x, w, group), cfg)
    return fastest_config(
        OP, key, cfg, candidates,
        check=lambda c: _checked(x, w, group, schedule=None, config=c, out=None),
        run=lambda c: gemm_ar(x, w, group, config=c),
        group=group, device=x.device,
        settle_plain=cfg.path == "auto",  # decode: host time decides (fastest.py says why)
    )  # fmt: skip


