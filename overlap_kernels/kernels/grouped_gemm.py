"""The grouped GEMM of the MoE ops: one product per local expert, rows gathered.

Output row ``i`` belongs to one expert (rows are grouped by expert) and reads
its A row through up to two levels of indexing, so that the dispatch GEMM can
read received tokens where they landed (no expansion copy):

    A_ROWS = 0   A row i                                  (A is recv_x itself)
    A_ROWS = 1   A row records[slots[i]][0]               (a pair record's row: kernels/routing.py)

Tiles come from a table (int32, columns below) in the order the host wants
them run: the dispatch GEMM puts the tiles whose sources arrive first first.
A tile with WAIT waits once, before its K loop (runtime/signals.py: "Where a
wait may stand"), on the flags of the sources its rows came from (a tile's
rows are sorted by source, so they form the range [src_lo, src_hi]).

Epilogues:
    PUSH = False  store the rounded tile into ``out`` rows i; with TMA_EPILOGUE a
                  tile whose rows are all its expert's (a whole block) is stored
                  by TMA, a block over an expert's end by pointers (a TMA box
                  would write the next expert's rows, another tile's)
    PUSH = True   multiply row i by ``weights[i]`` (fp32), round, and store it at
                  byte address ``dst_addr[i]`` (a peer's symmetric memory): the
                  fused combine's push. Completion is announced by the caller
                  after the kernel (stream order), not per tile.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from ..runtime.signals import wait_flag
from .gemm import (
    TL_DTYPES,
    TileConfig,
    input_precision,
    interpreted_bf16,
    round_output,
    store_block,
)
from .relaunch import ensure_descriptor_allocator
from .routing import RECORD_COLUMNS


class GroupedGemmConfig(TileConfig, Protocol):
    """A TileConfig with the grouped GEMM's TMA switch and epilogue (ops/moe.py's config)."""

    tma: bool
    epilogue: str


# Tile table columns (int32).
TILE_EXPERT = tl.constexpr(0)
TILE_ROW_START = tl.constexpr(1)
TILE_ROW_STOP = tl.constexpr(2)
TILE_N_START = tl.constexpr(3)
TILE_SRC_LO = tl.constexpr(4)
TILE_SRC_HI = tl.constexpr(5)
TILE_COLUMNS = 6  # host side (tables)
_TILE_COLUMNS = tl.constexpr(TILE_COLUMNS)  # kernel side
_RECORD_COLUMNS = tl.constexpr(RECORD_COLUMNS)


# Per-call values are not specialised on: a new variant compiled in the middle of
# a call would hold up every peer waiting for this rank.
@triton.jit(do_not_specialize=["epoch", "err_addr", "budget", "num_tiles", "num_rows", "out_rows"])
def grouped_gemm_kernel(
    a_ptr, stride_am,  # A rows [*, K]
    slots_ptr, records_ptr,  # A_ROWS = 1: int64 [R] and int32 [P, RECORD_COLUMNS]
    b_ptr, stride_be, stride_bk, stride_bn,  # B [E, K, N], any strides
    out_ptr, stride_om, out_rows,  # PUSH = False: out [out_rows, N]
    weights_ptr, dst_addr_ptr,  # PUSH = True: fp32 [R], int64 [R]
    tiles_ptr, num_tiles,  # int32 [num_tiles, TILE_COLUMNS]
    flags_ptr, epoch, err_addr, budget,  # WAIT: flag of source s at flags_ptr + s
    K, N, num_rows, num_experts,
    A_ROWS: tl.constexpr, WAIT: tl.constexpr, PUSH: tl.constexpr, OUT_DTYPE: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr, TMA_EPILOGUE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETED_BF16: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_SIGNALS: tl.constexpr,
):  # fmt: skip
    if A_TMA:  # A_ROWS = 0: rows past an expert's end are computed and not stored
        a_desc = tl.make_tensor_descriptor(a_ptr, [num_rows, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    if B_TMA:  # B as one matrix of all experts: [E * N, K] (B_NK) or [E * K, N]
        if B_NK:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, [num_experts * N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K]
            )
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, [num_experts * K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N]
            )
    out_desc = out_ptr  # (unused by the pointer epilogue)
    if TMA_EPILOGUE:
        out_desc = tl.make_tensor_descriptor(
            out_ptr, [out_rows, N], [stride_om, 1], [BLOCK_M, BLOCK_N]
        )
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        entry = tiles_ptr + tile * _TILE_COLUMNS
        expert = tl.load(entry + TILE_EXPERT).to(tl.int64)
        row_start = tl.load(entry + TILE_ROW_START)
        row_stop = tl.load(entry + TILE_ROW_STOP)
        n_start = tl.load(entry + TILE_N_START)
        if WAIT:
            for src in range(tl.load(entry + TILE_SRC_LO), tl.load(entry + TILE_SRC_HI) + 1):
                # (This rank's own flags, set as its copies land: no word to check.)
                arrived = wait_flag(
                    flags_ptr + src, epoch, err_addr, budget, src, src, flags_ptr, 0, FAST_SIGNALS
                )
                budget = tl.where(arrived, budget, 0)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_stop
        if A_ROWS == 1:
            slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
            a_rows = tl.load(
                records_ptr + slots.to(tl.int64) * _RECORD_COLUMNS, mask=row_ok, other=0
            ).to(tl.int64)
            # After a peer's timeout the records are stale: stay inside A.
            a_rows = tl.minimum(tl.maximum(a_rows, 0), num_rows - 1)
        else:
            a_rows = rows.to(tl.int64)
        cols = n_start + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        a_tile = a_ptr + a_rows[:, None] * stride_am
        b_tile = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            if A_TMA:
                a = a_desc.load([row_start, k0])
            else:
                a = tl.load(a_tile + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if B_TMA:
                if B_NK:  # columns past N come from the next expert and are not stored
                    b = b_desc.load([(expert * N + n_start).to(tl.int32), k0]).T
                else:  # K % BLOCK_K == 0 (launcher): a box never reaches the next expert
                    b = b_desc.load([(expert * K + k0).to(tl.int32), n_start])
            else:
                b = tl.load(
                    b_tile + ks[:, None].to(tl.int64) * stride_bk,
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
            if INTERPRETED_BF16:  # see kernels/gemm.py: round_output
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if PUSH:
            weights = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
            values = round_output(acc * weights[:, None], OUT_DTYPE, INTERPRETED_BF16)
            addr = tl.load(dst_addr_ptr + rows, mask=row_ok, other=0)
            itemsize: tl.constexpr = OUT_DTYPE.primitive_bitwidth // 8
            dst = (addr[:, None] + cols[None, :].to(tl.int64) * itemsize).to(
                tl.pointer_type(OUT_DTYPE)
            )
            tl.store(dst, values, mask=row_ok[:, None] & col_ok[None, :])
        else:
            store_block(out_desc, out_ptr, row_start, row_stop, n_start, N, stride_om, acc,
                        BLOCK_M, BLOCK_N, TMA_EPILOGUE, INTERPRETED_BF16)  # fmt: skip


def launch_grouped_gemm(
    a: torch.Tensor,  # [*, K], rows contiguous
    b: torch.Tensor,  # [E, K, N]
    tiles: torch.Tensor,  # int32 [num_tiles, TILE_COLUMNS] on a's device
    cfg: GroupedGemmConfig,
    num_programs: int,
    *,
    out: torch.Tensor | None = None,  # [R, N] (store epilogue)
    out_dtype: torch.dtype | None = None,
    slots: torch.Tensor | None = None,  # int64 [R] (A_ROWS = 1)
    records: torch.Tensor | None = None,  # int32 [P, RECORD_COLUMNS] (A_ROWS = 1)
    weights: torch.Tensor | None = None,  # fp32 [R] (push epilogue)
    dst_addr: torch.Tensor | None = None,  # int64 [R] (push epilogue)
    flags: torch.Tensor | None = None,  # int32 flags (WAIT)
    epoch: int = 0,
    err_addr: int = 0,
    budget: int = 0,
    fast_signals: bool = False,
) -> None:
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return
    push = dst_addr is not None
    dtype = out_dtype if push else out.dtype
    programs = max(1, min(num_programs, num_tiles))
    b_nk = b.stride(2) != 1  # a transposed view of [E, N, K]
    k, n = b.shape[1], b.shape[2]
    itemsize = a.element_size()
    tma_ok = cfg.tma and a.dtype != torch.float32  # fp32 keeps exact pointer loads
    # TMA boxes: 16-byte aligned rows and bases; a K-major B box must not cross an expert.
    a_tma = (
        tma_ok and slots is None and (a.stride(0) * itemsize) % 16 == 0 and a.data_ptr() % 16 == 0
    )
    b_contiguous = b.is_contiguous() or b.transpose(1, 2).is_contiguous()
    b_tma = tma_ok and b_contiguous and b.data_ptr() % 16 == 0 and \
        ((k * itemsize) % 16 == 0 if b_nk else (n * itemsize) % 16 == 0 and k % cfg.block_k == 0)  # fmt: skip
    # TMA stores: 16-byte aligned rows and base (a whole block never crosses an expert's end).
    tma_epilogue = (
        not push and cfg.epilogue == "tma" and out.stride(1) == 1 and out.data_ptr() % 16 == 0
        and (out.stride(0) * out.element_size()) % 16 == 0
    )  # fmt: skip
    if (a_tma or b_tma or tma_epilogue) and a.device.type == "cuda":
        ensure_descriptor_allocator()
    anchor = a if slots is None else slots
    grouped_gemm_kernel[(programs,)](
        a, a.stride(0),
        slots if slots is not None else anchor, records if records is not None else anchor,
        b, b.stride(0), b.stride(1), b.stride(2),
        out if out is not None else a, out.stride(0) if out is not None else 0,
        out.shape[0] if out is not None else 0,
        weights if push else a, dst_addr if push else a,
        tiles, num_tiles,
        flags if flags is not None else tiles, epoch, err_addr, budget,
        k, n, a.shape[0], b.shape[0],
        A_TMA=a_tma, B_TMA=b_tma, B_NK=b_nk, TMA_EPILOGUE=tma_epilogue,
        A_ROWS=int(slots is not None), WAIT=flags is not None, PUSH=push, OUT_DTYPE=TL_DTYPES[dtype],
        INPUT_PRECISION=input_precision(cfg), INTERPRETED_BF16=interpreted_bf16(a.dtype), NUM_PROGRAMS=programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FAST_SIGNALS=fast_signals,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
