"""The chunk-aware persistent GEMM: C = A @ B, walking M-blocks in arrival order.

The M-block table lists output row blocks in the order their rows become
available (a schedule's arrival order; plain row order for a local GEMM), each
with the chunk flag that announces its rows (-1: present before the launch).
Persistent programs take tiles round-robin in a grouped (L2-friendly) order
over that table, wait once per tile on the tile's flag (signals.py contract:
before the pipelined K loop, never inside it), then run the K loop with TMA
tensor descriptors at full speed.

A block never spans two chunks: each chunk's rows are cut into blocks of its
own, the last one masked, so one flag covers a block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.platform import INTERPRETER
from ..runtime.signals import wait_flag

# M-block table columns (int32): rows [start, stop), chunk-flag slot (-1: no wait), source rank.
# (tl.constexpr: kernels may read module globals only when they are constexpr.)
MBLOCK_START = tl.constexpr(0)
MBLOCK_STOP = tl.constexpr(1)
MBLOCK_FLAG = tl.constexpr(2)
MBLOCK_SRC = tl.constexpr(3)
MBLOCK_COLUMNS = tl.constexpr(4)


@triton.jit
def _grouped_tile(tile, num_mblocks, num_nblocks, GROUP_M: tl.constexpr):
    """(m-block, n-block) of ``tile``: GROUP_M m-blocks share each sweep over N,
    so the B columns they read stay in L2; m-blocks keep arrival order."""
    tiles_per_group = GROUP_M * num_nblocks
    first_mblock = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_mblocks - first_mblock, GROUP_M)
    in_group = tile % tiles_per_group
    return first_mblock + in_group % group_rows, in_group // group_rows


# torch dtype -> Triton dtype, for kernels that take an element type as a constexpr.
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def round_output(acc, OUT_DTYPE: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
    """fp32 accumulator -> output dtype, rounding to nearest even as cuBLAS does.
    triton 3.6's interpreter truncates fp32 -> bf16, so there it rounds by bits."""
    if INTERPRETED_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(OUT_DTYPE)
    return out


@triton.jit
def operand_descriptors(a_ptr, b_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, B_NK: tl.constexpr):  # fmt: skip
    """TMA descriptors of A [M, K] row-major and B [K, N] (stored [N, K] when B_NK)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    if B_NK:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.jit
def tile_product(
    a_desc, b_desc, row_start, col_start, k_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    B_NK: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRETED_BF16: tl.constexpr,
):  # fmt: skip
    """The fp32 accumulator of one output tile: the software-pipelined K loop,
    written once for every GEMM of the library. Nothing that waits on a flag may
    stand inside it (signals.py)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(0, k_tiles, num_stages=NUM_STAGES):
        a = a_desc.load([row_start, kt * BLOCK_K])
        if B_NK:
            b = b_desc.load([col_start, kt * BLOCK_K]).T
        else:
            b = b_desc.load([kt * BLOCK_K, col_start])
        if INTERPRETED_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


# Values that change from call to call are not specialised on (epoch == 1 would
# otherwise be a kernel of its own, compiled and loaded during a later call).
@triton.jit(do_not_specialize=["epoch", "err_addr", "wait_budget"])
def chunked_gemm_kernel(
    # operands: A [M, K] row-major, B [K, N] (stored [N, K] when B_NK), C [M, N]
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_cm,
    # tile order and the flags that gate it
    mblocks_ptr,  # int32 [num_mblocks, MBLOCK_COLUMNS]
    num_mblocks,
    chunk_flags_ptr,  # int32 chunk flags of this rank
    epoch,
    err_addr,
    wait_budget,
    # tuning
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    B_NK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FAST_SIGNALS: tl.constexpr,
    INTERPRETED_BF16: tl.constexpr,  # bf16 in Triton's interpreter: see launch_chunked_gemm
):
    a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_NK)
    num_nblocks = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_mblocks * num_nblocks
    budget = wait_budget
    # Not software-pipelined (only the K loop is): the wait below must stay
    # ahead of every load of its tile.
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        mblock, nblock = _grouped_tile(tile, num_mblocks, num_nblocks, GROUP_M)
        entry = mblocks_ptr + mblock * MBLOCK_COLUMNS
        row_start = tl.load(entry + MBLOCK_START)
        row_stop = tl.load(entry + MBLOCK_STOP)
        flag = tl.load(entry + MBLOCK_FLAG)
        if flag >= 0:
            src = tl.load(entry + MBLOCK_SRC)
            arrived = wait_flag(chunk_flags_ptr + flag, epoch, err_addr, budget, src, flag, FAST_SIGNALS)
            # After one timeout this program's later waits fail at once: the
            # output is garbage anyway and the host raises.
            budget = tl.where(arrived, budget, 0)
        col_start = nblock * BLOCK_N
        acc = tile_product(
            a_desc, b_desc, row_start, col_start, k_tiles,
            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, B_NK, INPUT_PRECISION, INTERPRETED_BF16,
        )  # fmt: skip
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, round_output(acc, c_ptr.dtype.element_ty, INTERPRETED_BF16), mask=mask)


_ALLOCATOR_SET = False


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from an allocator."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True


def input_precision(config) -> str:
    """tl.dot's precision: exact fp32 unless the config allows TF32 (bf16/fp16 ignore it)."""
    return "tf32" if config.allow_tf32 else "ieee"


def interpreted_bf16(dtype: torch.dtype) -> bool:
    """triton 3.6's interpreter computes bf16 dots wrongly and truncates when it
    rounds to bf16; fp32 operands give the same products (bf16 x bf16 is exact
    in fp32) and round_output rounds by bits."""
    return INTERPRETER and dtype == torch.bfloat16


def core_launch_args(a: torch.Tensor, b: torch.Tensor, config, fast_signals: bool) -> tuple[torch.Tensor, dict]:
    """What every launch of a kernel built on :func:`tile_product` passes alike:
    B as the kernel reads it (the [N, K] base of a ``weight.t()``), and the
    GEMM core's constexprs and warps. Sets up the descriptor allocator on CUDA."""
    if a.device.type == "cuda":
        ensure_descriptor_allocator()
    b_nk = b.stride(0) == 1  # the transpose of an [N, K] row-major weight (nn.Linear layout)
    options = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "NUM_STAGES": config.num_stages,
        "B_NK": b_nk,
        "INPUT_PRECISION": input_precision(config),
        "FAST_SIGNALS": fast_signals,
        "INTERPRETED_BF16": interpreted_bf16(a.dtype),
        "num_warps": config.num_warps,
    }
    return (b.t() if b_nk else b), options


def mblock_table(spans: list[tuple[int, int, int, int]], block_m: int, device) -> torch.Tensor:
    """The M-block table for ``spans`` = [(row start, row stop, flag slot or -1, source)]
    in arrival order: each span cut into blocks of ``block_m`` rows."""
    rows = []
    for start, stop, flag, src in spans:
        for block_start in range(start, stop, block_m):
            rows.append((block_start, min(block_start + block_m, stop), flag, src))
    if not rows:
        rows.append((0, 0, -1, 0))  # keeps the table non-empty; a zero-row block stores nothing
    return torch.tensor(rows, dtype=torch.int32, device=device)


def launch_chunked_gemm(
    a: torch.Tensor,  # [M, K] row-major
    b: torch.Tensor,  # [K, N]: row-major, or the transpose of a row-major [N, K]
    out: torch.Tensor,  # [M, N] row-major
    mblocks: torch.Tensor,
    config,
    num_programs: int,
    *,
    chunk_flags: torch.Tensor | None = None,
    epoch: int = 0,
    err_addr: int = 0,
    wait_budget: int = 0,
    fast_signals: bool = False,
) -> None:
    """Launch :func:`chunked_gemm_kernel` (operand layouts checked by the caller)."""
    b_base, core = core_launch_args(a, b, config, fast_signals)
    M, K = a.shape
    N = b.shape[1]
    num_tiles = mblocks.shape[0] * triton.cdiv(N, config.block_n)
    programs = max(1, min(num_programs, num_tiles))
    flags = chunk_flags if chunk_flags is not None else mblocks  # never read when no flag is set
    chunked_gemm_kernel[(programs,)](
        a, b_base, out, M, N, K, out.stride(0),
        mblocks, mblocks.shape[0], flags, epoch, err_addr, wait_budget,
        GROUP_M=config.group_m, NUM_PROGRAMS=programs, **core,
    )  # fmt: skip
