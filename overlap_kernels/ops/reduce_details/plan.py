"""What one rank does in a gemm_rs / gemm_ar call: the tile table of the
producer GEMM (kernels/reduce_gemm.py), where partials and sums live in the
workspace, which flag slots announce them, and the copies the communication
stream makes. Built once per (schedule, shape, buffer half) and cached in the
workspace, so a call does no host-side work beyond its launches.

Rows: rank r owns rows [r * M // world, (r + 1) * M // world) of the [M, N]
product (its *segment*), cut into ``pieces`` equal pieces.

Flag slots (chunk flags; P = pieces). Slots set by this rank's own streams
lie below LOCAL_FLAGS; each peer writes only its own range of the rest,
W(src) = LOCAL_FLAGS + src * limits.writer_flags(world) (why: its docstring).
    PUSHED(src, piece) = W(src) + piece       src pushed its partial into our slot
    STAGED(src, piece) = W(src) + piece       src staged its partial in its memory
    FINAL(owner, piece) = W(owner) + P + piece   (gemm_ar) the owner's sum is published
    PULLED(src, piece) = src * P + piece      our copy engine pulled it into our slot
A reduction waits on PUSHED or PULLED, so a schedule moves every partial by one
mechanism. One-shot gemm_ar has a flag per tile: PUSHED(src, tile) = W(src) + tile.
Pieces with no rows (a segment shorter than ``pieces``) have no tiles, no
signal and no copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...kernels.reduce_gemm import PUBLISH, PUSH, PUSH_ALL, REDUCE, STAGE
from ...limits import DATA_OFFSET, LOCAL_FLAGS, SCHEDULE_FLAGS, writer_flags
from ...runtime.workspace import Workspace
from ...schedules import COPY_ENGINE, LOCAL, ChunkSchedule
from ...schedules.chunks import PUSH as PUSH_MECHANISM

if TYPE_CHECKING:
    from ..gemm_ar import GemmArConfig
    from ..gemm_rs import GemmRsConfig

TRITON, CUBLAS = "triton", "cublas"  # config producer: what computes the pieces of peers' rows


def segment(rank: int, m: int, world: int) -> tuple[int, int]:
    """Rows of the product that ``rank`` owns."""
    return rank * m // world, (rank + 1) * m // world


def piece_rows(owner: int, piece: int, pieces: int, m: int, world: int) -> tuple[int, int]:
    start, stop = segment(owner, m, world)
    length = stop - start
    return start + piece * length // pieces, start + (piece + 1) * length // pieces


def plan_key(
    op: str,
    schedule: ChunkSchedule | None,
    cfg: GemmRsConfig | GemmArConfig,
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    half: int,
) -> tuple:
    """What a plan, and the compiled kernels it loads before its first call
    (run.py), depend on: a call that differs in any of these gets its own plan
    and warm-up, so no kernel is compiled and loaded mid-call."""
    return (op, schedule, cfg, tuple(x.shape), tuple(w.shape), w.stride(), x.dtype,
            out.data_ptr() % 16, half)  # fmt: skip


def _align(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


@dataclass(frozen=True)
class CopyStep:
    """A copy on the communication stream, gated by a flag set by a peer's kernel."""

    peer: int  # who set the flag (named by a timeout)
    wait_slot: int  # chunk flag this rank waits on before copying
    rows: tuple[int, int]  # rows of the [M, N] product that move
    src: torch.Tensor  # where they are (a peer view)
    dst: torch.Tensor | None  # where they go (None: rows of the caller's out)
    done_slot: int  # chunk flag set after the copy (-1: none)


@dataclass(frozen=True)
class StagedPiece:
    """Rows of a peer's segment that a cuBLAS producer computes in one matmul,
    then announces with the owner's flags: a pulled piece into this rank's
    memory (STAGED, for the owner to pull), or all of a pushed owner's pieces
    at once, straight into this rank's slot in the owner's memory (PUSHED):
    no transfer follows a pushed product for smaller pieces to start sooner,
    and smaller matmuls run slower."""

    rows: tuple[int, int]  # rows of x (and of the [M, N] product)
    dst: (
        torch.Tensor
    )  # where the product goes: those rows of this rank's rows region, or of the owner's slot
    owner_flags: torch.Tensor  # the owner's chunk flags (a peer view)
    flags: tuple[
        int, ...
    ]  # the slots of STAGED(rank, piece) or PUSHED(rank, piece) there, one per piece


@dataclass(frozen=True)
class ReducePlan:
    tiles: torch.Tensor  # int32 [num_tiles, len(TILE_COLUMNS)]
    num_tiles: int
    num_producer_tiles: int  # tiles before the first REDUCE tile
    gemm_start: int  # first tile our GEMM runs: past the producer tiles where cuBLAS makes them
    slots_offset: int  # byte offsets from every rank's base address (kernel arguments)
    slot_rows: int
    rows_offset: int
    wait_stride: int
    pulls: tuple[CopyStep, ...]  # partials the owner pulls into its slots (before its REDUCE tiles)
    # gemm_ar: published sums copied into out, in lanes (one communication
    # stream each; owners dealt to lanes by distance, config gather_streams)
    gathers: tuple[tuple[CopyStep, ...], ...]
    staged: tuple[StagedPiece, ...]  # pieces of peers' rows in production order (cuBLAS producer)
    # first tile -> the Relaunch of the GEMM launch from there; ("wait", slot) -> of a
    # copy's flag wait (run.py fills them on CUDA)
    relaunches: dict = field(default_factory=dict, compare=False)

    @property
    def one_launch(self) -> bool:
        """Whether a call is the producer GEMM's one launch, with no copy or cuBLAS
        product beside it (its replays pick their buffer half on the device: ops/replay.py)."""
        return not (self.pulls or self.gathers or self.staged)


def region_bytes(m: int, n: int, world: int, itemsize: int, one_shot: bool) -> tuple[int, int, int]:
    """(slot rows, byte size of the slots, byte size of the rows region) for a call."""
    slot_rows = m if one_shot else -(-m // world)
    return slot_rows, _align(world * slot_rows * n * itemsize), _align(m * n * itemsize)


def _grouped(
    mblocks: list[tuple[int, int]], num_nblocks: int, group_m: int
) -> list[tuple[int, int, int]]:
    """(row start, row stop, n-block) in grouped order: ``group_m`` m-blocks share
    a sweep over N, so the columns of B they read stay in L2."""
    order = []
    for first in range(0, len(mblocks), group_m):
        group = mblocks[first : first + group_m]
        for nblock in range(num_nblocks):
            order += [(start, stop, nblock) for start, stop in group]
    return order


def _mblocks(start: int, stop: int, block_m: int) -> list[tuple[int, int]]:
    return [(s, min(s + block_m, stop)) for s in range(start, stop, block_m)]


def build_two_shot(
    ws: Workspace,
    schedule: ChunkSchedule,
    m: int,
    n: int,
    dtype: torch.dtype,
    cfg: GemmRsConfig | GemmArConfig,
    half_offset: int,
    *,
    publish: bool,
) -> ReducePlan:
    """Plan of gemm_rs (``publish=False``) and of gemm_ar's two-shot path: partials
    reduced by their owner, then (gemm_ar) the sums gathered by every rank.
    With ``cfg.producer == "cublas"`` the pieces of peers' rows are staged
    pieces (run.py computes them with torch.matmul; pushed ones one product
    per owner, at the place of the owner's first non-empty piece); their
    tiles stay in the table, before ``num_producer_tiles``, and are skipped."""
    world, rank = ws.world, ws.rank
    pieces = schedule.for_rank(0)[0].pieces
    itemsize = dtype.itemsize
    slot_rows, slots_bytes, _ = region_bytes(m, n, world, itemsize, one_shot=False)
    slots_at, rows_at = half_offset, half_offset + slots_bytes  # within the data region
    num_nblocks = -(-n // cfg.block_n)

    pulled = schedule.mechanisms == {COPY_ENGINE}

    per_writer = writer_flags(world)

    def pushed(src: int, piece: int) -> int:  # also STAGED
        return LOCAL_FLAGS + src * per_writer + piece

    def pulled_slot(src: int, piece: int) -> int:
        return src * pieces + piece

    def final(owner: int, piece: int) -> int:
        return LOCAL_FLAGS + owner * per_writer + pieces + piece

    arrived, wait_stride = (pulled_slot, pieces) if pulled else (pushed, per_writer)

    own_start = segment(rank, m, world)[0]
    out_row0 = 0 if publish else own_start  # gemm_ar's out holds all M rows, gemm_rs's the segment
    rows_out, num_producer_tiles = [], None
    staged_pieces: list[StagedPiece] = []  # pulled pieces, one product each
    # owner -> its pieces' flags: pushed, one product per owner
    pushed_flags: dict[int, list[int]] = {}
    by_cublas = cfg.producer == CUBLAS
    for chunk in schedule.for_rank(rank):
        start, stop = piece_rows(chunk.src, chunk.piece, pieces, m, world)
        seg_start = segment(chunk.src, m, world)[0]
        if by_cublas and chunk.mechanism == COPY_ENGINE and stop > start:
            staged_pieces.append(StagedPiece((start, stop), ws.data(rank, rows_at, (m, n), dtype)[start:stop],
                                             ws.peer_chunk_flags(chunk.src), (pushed(rank, chunk.piece),)))  # fmt: skip
        elif by_cublas and chunk.mechanism != LOCAL and stop > start:
            pushed_flags.setdefault(chunk.src, []).append(pushed(rank, chunk.piece))
        tiles = _grouped(_mblocks(start, stop, cfg.block_m), num_nblocks, cfg.group_m)
        if chunk.mechanism == LOCAL:
            num_producer_tiles = len(rows_out) if num_producer_tiles is None else num_producer_tiles
            role = REDUCE | (PUBLISH if publish else 0)
            counter, signal = world * pieces + chunk.piece, final(rank, chunk.piece)
        else:
            role = PUSH if chunk.mechanism == PUSH_MECHANISM else STAGE
            counter = chunk.src * pieces + chunk.piece
            signal = pushed(rank, chunk.piece)  # at the owner: PUSHED or STAGED
        for row_start, row_stop, nblock in tiles:
            rows_out.append((row_start, row_stop, nblock * cfg.block_n, role, chunk.src, seg_start,
                             counter, len(tiles), signal, arrived(0, chunk.piece), out_row0))  # fmt: skip

    pulls, gathers = [], []
    for src in range(world):  # partials this rank pulls, in the order their producers make them
        for position, chunk in enumerate(schedule.for_rank(src)):
            start, stop = piece_rows(rank, chunk.piece, pieces, m, world)
            if chunk.src == rank and chunk.mechanism == COPY_ENGINE and stop > start:
                staged = ws.data(src, rows_at, (m, n), dtype)[start:stop]
                slot = ws.data(rank, slots_at, (world, slot_rows, n), dtype)[src]
                step = CopyStep(src, pushed(src, chunk.piece), (start, stop), staged,
                                slot[start - own_start : stop - own_start], pulled_slot(src, chunk.piece))  # fmt: skip
                pulls.append((position, src, step))
    if publish:
        for owner in range(world):
            if owner == rank:
                continue
            for position, chunk in enumerate(schedule.for_rank(owner)):
                start, stop = piece_rows(owner, chunk.piece, pieces, m, world)
                if chunk.mechanism == LOCAL and stop > start:
                    published = ws.data(owner, rows_at, (m, n), dtype)[start:stop]
                    gathers.append((position, (owner - rank) % world,
                                    CopyStep(owner, final(owner, chunk.piece), (start, stop), published, None, -1)))  # fmt: skip
    for owner, flags in pushed_flags.items():  # the whole segment, into this rank's slot there
        start, stop = segment(owner, m, world)
        slot = ws.data(owner, slots_at, (world, slot_rows, n), dtype)[rank]
        staged_pieces.append(
            StagedPiece(
                (start, stop), slot[: stop - start], ws.peer_chunk_flags(owner), tuple(flags)
            )
        )
    lanes = min(cfg.gather_streams, world - 1) if gathers else 0
    gathers.sort(key=lambda g: g[:2])  # in the order the owners publish, nearest first
    num_producer_tiles = len(rows_out) if num_producer_tiles is None else num_producer_tiles
    return ReducePlan(
        tiles=_table(rows_out, ws.device),
        num_tiles=len(rows_out),
        num_producer_tiles=num_producer_tiles,
        gemm_start=num_producer_tiles if by_cublas else 0,
        slots_offset=DATA_OFFSET + slots_at,
        slot_rows=slot_rows,
        rows_offset=DATA_OFFSET + rows_at,
        wait_stride=wait_stride,
        pulls=tuple(step for *_, step in sorted(pulls, key=lambda p: p[:2])),
        gathers=tuple(
            tuple(step for _, distance, step in gathers if (distance - 1) % lanes == lane)
            for lane in range(lanes)
        ),
        staged=tuple(staged_pieces),
    )


def one_shot_tiles(m: int, n: int, cfg: GemmArConfig) -> int:
    return -(-m // cfg.block_m) * -(-n // cfg.block_n)


def one_shot_fits(m: int, n: int, world: int, cfg: GemmArConfig) -> bool:
    """One flag per tile must fit in each writer's range."""
    return one_shot_tiles(m, n, cfg) <= writer_flags(world)


def two_shot_fits(world: int, pieces: int, pulled: bool = False) -> bool:
    """PUSHED/STAGED and FINAL flags per piece must fit in each writer's range,
    and PULLED flags (world x pieces) among a schedule's (limits.SCHEDULE_FLAGS)."""
    return 2 * pieces <= writer_flags(world) and (not pulled or world * pieces <= SCHEDULE_FLAGS)


def build_one_shot(
    ws: Workspace, m: int, n: int, dtype: torch.dtype, cfg: GemmArConfig, half_offset: int
) -> ReducePlan:
    """Plan of gemm_ar's one-shot path: every tile pushed to every peer, then
    summed from every peer's copy. Tiles are in the same (grouped) order on every rank."""
    world, rank = ws.world, ws.rank
    slot_rows, slots_bytes, _ = region_bytes(m, n, world, dtype.itemsize, one_shot=True)
    num_nblocks = -(-n // cfg.block_n)
    tiles = _grouped(_mblocks(0, m, cfg.block_m), num_nblocks, cfg.group_m)
    total, per_writer = len(tiles), writer_flags(world)
    rows_out = [
        (
            start,
            stop,
            nblock * cfg.block_n,
            PUSH_ALL | REDUCE,
            rank,
            0,
            t,
            1,
            LOCAL_FLAGS + rank * per_writer + t,
            LOCAL_FLAGS + t,
            0,
        )
        for t, (start, stop, nblock) in enumerate(tiles)
    ]
    return ReducePlan(
        tiles=_table(rows_out, ws.device),
        num_tiles=total,
        num_producer_tiles=0,
        gemm_start=0,
        slots_offset=DATA_OFFSET + half_offset,
        slot_rows=slot_rows,
        rows_offset=DATA_OFFSET + half_offset + slots_bytes,
        wait_stride=per_writer,
        pulls=(),
        gathers=(),
        staged=(),
    )


def _table(rows: list[tuple], device) -> torch.Tensor:
    from ...kernels.reduce_gemm import TILE_COLUMNS

    if not rows:
        return torch.zeros((1, len(TILE_COLUMNS)), dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)
