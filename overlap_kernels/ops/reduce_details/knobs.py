"""The knobs gemm_rs and gemm_ar's two_shot path share: how partials move,
what computes peers' pieces, when own pieces are reduced, a user's producer
schedule, and the candidates an autotune measures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...schedules import COPY_ENGINE, PUSH, ChunkSchedule
from ...schedules.producers import own_pieces_last, producer_problems
from ..checks import require
from .plan import CUBLAS, TRITON, two_shot_fits

if TYPE_CHECKING:
    from ..gemm_ar import GemmArConfig
    from ..gemm_rs import GemmRsConfig

MECHANISMS = (PUSH, COPY_ENGINE)
PRODUCERS = (TRITON, CUBLAS)


def check_partials_knobs(
    op: str,
    cfg: GemmRsConfig | GemmArConfig,
    *,
    producers: tuple[str, ...] = PRODUCERS,
    lag_with_pulls: bool = True,
) -> None:
    """``mechanism``, ``producer`` (one of the op's ``producers``) and ``lag``
    (``lag_with_pulls=False``: an op that ignores it for pulled partials,
    which are always reduced last)."""
    require(
        cfg.mechanism in MECHANISMS,
        op,
        f"config: mechanism must be push or copy_engine, got '{cfg.mechanism}'",
    )
    require(
        cfg.producer in producers,
        op,
        f"config: producer must be {' or '.join(producers)}, got '{cfg.producer}'",
    )
    require(cfg.producer != CUBLAS or cfg.lag is None or cfg.lag >= cfg.pieces, op,
            f"config: producer 'cublas' computes every peer's piece before our GEMM runs the own rows: lag None or >= pieces, got lag {cfg.lag}")  # fmt: skip
    require(cfg.lag is None or cfg.lag >= 1, op, f"config: lag must be None or >= 1, got {cfg.lag}")
    require(not lag_with_pulls or cfg.mechanism != COPY_ENGINE or cfg.lag is None or cfg.lag >= cfg.pieces, op,
            f"config: copy_engine pulls need every rank's own pieces last: lag None or >= pieces, got lag {cfg.lag}")  # fmt: skip


def partials_candidates(
    cfg: GemmRsConfig | GemmArConfig,
    fused_path: str,
    producers: tuple[str, ...] = PRODUCERS,
    pull_producers: tuple[str, ...] = PRODUCERS,
) -> tuple[dict, ...]:
    """What an autotune measures (changes to ``cfg``): ``fused_path`` pushing
    with every one of ``producers``, pulling by the copy engine with every one
    of ``pull_producers`` (own pieces last, an SM left for the flag waits),
    and the plain path. cuBLAS reduces its own pieces last too (lag None)."""
    pushed = ({"path": fused_path, "mechanism": PUSH, "producer": p} | ({"lag": None} if p == CUBLAS else {})
              for p in producers)  # fmt: skip
    pulled = {
        "path": fused_path,
        "mechanism": COPY_ENGINE,
        "comm_sms": max(1, cfg.comm_sms),
        "lag": None,
    }
    return (*pushed, *({**pulled, "producer": p} for p in pull_producers), {"path": "sequential"})


def check_producer_schedule(
    op: str,
    schedule: ChunkSchedule,
    world: int,
    mechanisms: tuple[str, ...],
    cfg: GemmRsConfig | GemmArConfig,
) -> None:
    """A user's producer schedule, checked against the op and the call's config."""
    require(isinstance(schedule, ChunkSchedule), op, "schedule must be a ChunkSchedule")
    require(
        schedule.world_size == world,
        op,
        f"schedule is for {schedule.world_size} ranks, group has {world}",
    )
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
