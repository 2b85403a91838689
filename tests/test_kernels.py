"""The chunk-aware GEMM and the signal helpers on one process (Triton's interpreter on CPU).

The multi-rank tests move every chunk before the GEMM starts on CPU, so here
the GEMM's own waits are exercised directly: tiles whose flag holds the epoch
run, a tile whose flag never comes times out, fills the error record with its
source rank and chunk, and does not stop the other tiles.
"""

from __future__ import annotations

import pytest
import torch

import overlap_kernels as ok  # (before Triton: it turns the interpreter on where no GPU is)

# isort: split
import triton
import triton.language as tl

from overlap_kernels.kernels.gemm import (
    _grouped_tile,
    chunk_mblocks,
    launch_chunked_gemm,
    mblock_table,
    split_tail,
    tail_scratch,
)
from overlap_kernels.reference import check_matmul, poisoned
from overlap_kernels.runtime.errors import (
    CODE_TIMEOUT,
    ERR_CHUNK,
    ERR_CODE,
    ERR_DEADLINE_MS,
    ERR_EPOCH,
    ERR_PEER,
    ERR_RECORD_LEN,
)
from overlap_kernels.runtime.platform import num_sms
from overlap_kernels.runtime.signals import wait_budget
from overlap_kernels.tuning import build_config, shape_key


def _config():
    return build_config(ok.AgGemmConfig, "ag_gemm", {"world": 2, "m": 40, "k": 64, "n": 48}, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_layout", ["kn", "nk"])
def test_matmul_matches_fp64(dtype, weight_layout):
    a = torch.randn(37, 96, dtype=dtype)
    b = (
        torch.randn(96, 56, dtype=dtype)
        if weight_layout == "kn"
        else torch.randn(56, 96, dtype=dtype).t()
    )
    out = poisoned((37, 56), dtype, "cpu")
    assert ok.matmul(a, b, out=out) is out
    check_matmul(out, a, b, f"matmul {dtype} {weight_layout}")


def test_gemm_waits_per_chunk_and_times_out_on_a_missing_one():
    torch.manual_seed(0)
    a = torch.randn(40, 64)
    b = torch.randn(64, 48)
    epoch = 7
    flags = torch.zeros(8, dtype=torch.int32)
    flags[0] = epoch  # chunk 0 (rows 20:30, from rank 1) has arrived
    flags[1] = epoch - 1  # chunk 1 (rows 30:40, from rank 3) holds an older call's epoch: stale
    spans = [(0, 20, -1, 0), (20, 30, 0, 1), (30, 40, 1, 3)]
    cfg = _config()
    table = mblock_table(spans, cfg.block_m, "cpu")
    err = torch.zeros(ERR_RECORD_LEN, dtype=torch.int32)  # (the kernel writes every field)
    out = poisoned((40, 48), torch.float32, "cpu")
    launch_chunked_gemm(
        a, b, out, table, cfg, 2, chunk_flags=flags, epoch=epoch, err_addr=err.data_ptr(),
        wait_budget=wait_budget(0.3),
    )  # fmt: skip
    assert err[ERR_CODE] == CODE_TIMEOUT
    assert (err[ERR_EPOCH], err[ERR_PEER], err[ERR_CHUNK]) == (epoch, 3, 1)
    assert err[ERR_DEADLINE_MS] == 300  # the deadline the wait had (wait_budget(0.3))
    # Rows whose data was there are right; the timed-out chunk's rows were still written.
    check_matmul(out[:30], a[:30], b, "rows that had arrived")
    assert not out.isnan().any()


def _ragged_tma_case(device, dtype, block_m):
    """A GEMM over chunks of uneven rows (a block cut short inside C, not only
    at its end) by both epilogues. Rows [gap, gap + 5) belong to no chunk: a
    cut block that stored whole would write them (in ag_gemm, the first rows
    of a chunk that may not have arrived yet)."""
    gap = 3 * block_m - 5
    spans = [(0, gap, -1, 0), (gap + 5, 4 * block_m, -1, 1), (4 * block_m, 5 * block_m + 7, -1, 2)]
    m, k, n = spans[-1][1], 256, 328  # N not a multiple of block_n: a cut column tile too
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(n, k, dtype=dtype, device=device).t()
    rows = torch.ones(m, dtype=torch.bool)
    rows[gap : gap + 5] = False
    outs = {}
    for epilogue in ("pointer", "tma"):
        cfg = build_config(ok.AgGemmConfig, "ag_gemm", shape_key(1, m, k, n, dtype),
                           {"block_m": block_m, "epilogue": epilogue})  # fmt: skip
        out = poisoned((m, n), dtype, device)
        launch_chunked_gemm(
            a, b, out, mblock_table(spans, block_m, device), cfg, num_sms(torch.device(device))
        )
        out = out.cpu()
        assert out[~rows].isnan().all(), f"{epilogue}: a cut block wrote rows of no chunk"
        check_matmul(out[rows], a.cpu()[rows], b.cpu(), f"{epilogue} epilogue, ragged chunks")
        outs[epilogue] = out[rows]
    assert torch.equal(outs["tma"], outs["pointer"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_layout", ["kn", "nk"])
def test_pointer_loads_match_fp64(dtype, weight_layout):
    """Config loads="pointer" reads the operands by masked loads: at M, N and K that no
    tile divides (the masks stand where TMA's bounds did) the product matches fp64
    (TMA loads': test_matmul_matches_fp64)."""
    torch.manual_seed(2)
    m, k, n = 37, 104, 56  # K = 3 whole 32-wide steps and an 8-wide one
    a = torch.randn(m, k, dtype=dtype)
    b = (
        torch.randn(k, n, dtype=dtype)
        if weight_layout == "kn"
        else torch.randn(n, k, dtype=dtype).t()
    )
    out = ok.matmul(a, b, {"loads": "pointer"}, out=poisoned((m, n), dtype, "cpu"))
    check_matmul(out, a, b, f"pointer loads {dtype} {weight_layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 4])
def test_pointer_loads_on_gpu(stages):
    """Decode tiles (plain loads at one stage, asynchronous copies at four) and a ragged
    prefill-sized product, against fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(3)
    tile = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": stages}
    for m, k, n, knobs in ((1, 7168, 8192, tile), (13, 4104, 1000, tile), (300, 1032, 1000, {})):
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
        out = ok.matmul(
            a, b, {**knobs, "loads": "pointer"}, out=poisoned((m, n), torch.bfloat16, "cuda")
        )
        check_matmul(out.cpu(), a.cpu(), b.cpu(), f"pointer loads {m}x{k}x{n} {knobs}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tma_epilogue_stores_what_the_pointer_epilogue_stores(dtype):
    _ragged_tma_case("cpu", dtype, 16)


@pytest.mark.gpu
def test_tma_epilogue_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _ragged_tma_case("cuda", torch.bfloat16, 128)
    m, k, n = 4096, 1024, 4096  # whole blocks: every tile by TMA, several tiles a program
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
    by_tma = ok.matmul(a, b, {"epilogue": "tma"}, out=poisoned((m, n), torch.bfloat16, "cuda"))
    assert torch.equal(by_tma, ok.matmul(a, b, {"epilogue": "pointer"}))
    check_matmul(by_tma.cpu(), a.cpu(), b.cpu(), "tma epilogue, whole blocks")


def test_mblock_table_cuts_each_chunk_on_its_own():
    table = mblock_table([(0, 5, -1, 0), (5, 21, 3, 1)], 8, "cpu").tolist()
    assert table == [[0, 5, -1, 0], [5, 13, 3, 1], [13, 21, 3, 1]]
    assert mblock_table([], 8, "cpu").tolist() == [[0, 0, -1, 0]]


def test_chunk_mblocks_is_a_chunks_count_only_where_every_chunk_has_it():
    assert chunk_mblocks([(0, 16, -1, 0), (16, 32, 0, 1), (32, 48, 1, 2)], 8) == 2
    assert chunk_mblocks([(0, 9, -1, 0), (9, 18, 0, 1)], 8) == 2  # each cut into 8 + 1 rows
    assert chunk_mblocks([(0, 16, -1, 0), (16, 24, 0, 1)], 8) == 3  # 2 and 1: all of them
    assert chunk_mblocks([(0, 8, -1, 0), (8, 8, 0, 1), (8, 16, 1, 2)], 8) == 1  # an empty piece
    assert chunk_mblocks([(0, 0, -1, 0)], 8) == 1


@triton.jit
def _tile_order_kernel(out_ptr, num_mblocks, num_nblocks, group_span, NUM_TILES: tl.constexpr,
                       GROUP_M: tl.constexpr):  # fmt: skip
    for tile in range(NUM_TILES):
        mblock, nblock = _grouped_tile(tile, num_mblocks, num_nblocks, group_span, GROUP_M)
        tl.store(out_ptr + 2 * tile, mblock)
        tl.store(out_ptr + 2 * tile + 1, nblock)


def _tile_order(num_mblocks, num_nblocks, group_span, group_m) -> list[tuple[int, int]]:
    tiles = num_mblocks * num_nblocks
    out = torch.full((tiles, 2), -1, dtype=torch.int32)
    _tile_order_kernel[(1,)](out, num_mblocks, num_nblocks, group_span, tiles, group_m)
    return [tuple(pair) for pair in out.tolist()]


@pytest.mark.parametrize(
    ("num_mblocks", "num_nblocks", "span", "group_m"),
    [(16, 3, 4, 8), (16, 3, 8, 8), (10, 2, 4, 3), (9, 5, 9, 4), (7, 3, 2, 1)],
)
def test_tile_groups_end_where_a_chunk_ends(num_mblocks, num_nblocks, span, group_m):
    """Every tile once; a chunk's (``span`` m-blocks) tiles all before the next
    chunk's; inside a chunk, group_m m-blocks share each sweep over N (the last
    group of a chunk smaller); a span of every m-block is the plain grouped order."""
    order = _tile_order(num_mblocks, num_nblocks, span, group_m)
    assert sorted(order) == [(m, n) for m in range(num_mblocks) for n in range(num_nblocks)]
    chunks = [m // span for m, _ in order]
    assert chunks == sorted(chunks), "a group holds tiles of two chunks"
    expected = []
    for first in range(0, num_mblocks, span):
        rows = min(span, num_mblocks - first)
        for g in range(0, rows, group_m):
            members = range(first + g, first + min(g + group_m, rows))
            expected += [(m, n) for n in range(num_nblocks) for m in members]
    assert order == expected
    plain = []
    for g in range(0, num_mblocks, group_m):
        members = range(g, min(g + group_m, num_mblocks))
        plain += [(m, n) for n in range(num_nblocks) for m in members]
    assert _tile_order(num_mblocks, num_nblocks, num_mblocks, group_m) == plain


def test_gemm_with_chunk_groups_matches_fp64():
    """Chunks of 3 m-blocks and group_m 2: groups end at every chunk's end; the
    split tail (the last chunk's tiles) still sums right."""
    torch.manual_seed(2)
    a, b = torch.randn(144, 64), torch.randn(64, 80)
    cfg = build_config(ok.AgGemmConfig, "ag_gemm", shape_key(1, 144, 64, 80, a.dtype),
                       {"block_m": 16, "group_m": 2})  # fmt: skip
    spans = [(0, 48, -1, 0), (48, 96, -1, 1), (96, 144, -1, 2)]
    assert chunk_mblocks(spans, 16) == 3
    tiles, programs = 9 * -(-80 // cfg.block_n), 5
    assert split_tail(tiles, programs, -(-64 // cfg.block_k))[1] > 1, "the case must split"
    out = poisoned((144, 80), torch.float32, "cpu")
    launch_chunked_gemm(a, b, out, mblock_table(spans, 16, "cpu"), cfg, programs, group_span=3)
    check_matmul(out, a, b, "chunk groups")


@pytest.mark.parametrize(("tiles", "programs", "k_tiles", "split"), [
    (9, 4, 8, (8, 4)),  # 2 waves and 1 tile: that tile in 4 K pieces
    (10, 4, 8, (8, 2)),  # a half-full last wave: 2 pieces a tile
    (11, 4, 8, (11, 1)),  # 3 of 4 in the last wave: no split
    (8, 4, 8, (8, 1)),  # even waves: no split
    (3, 8, 8, (0, 2)),  # fewer tiles than programs: the one wave is split
    (9, 4, 2, (8, 2)),  # no more pieces than K steps
    (448, 131, 128, (393, 2)),  # 2048x8192x7168 on H200 (131 programs): the last 55 tiles in halves
    (1792, 131, 128, (1792, 1)),  # 8192x8192x7168: a last wave of 89 tiles, too full to split
])  # fmt: skip
def test_split_tail_cuts_a_short_last_wave_along_k(tiles, programs, k_tiles, split):
    first, pieces = split_tail(tiles, programs, k_tiles)
    assert (first, pieces) == split
    assert (tiles - first) * pieces <= programs, "one piece per program"


@pytest.mark.parametrize(
    ("m", "k", "n", "block_m", "loads"),
    [(72, 96, 80, 32, "tma"), (33, 48, 160, 32, "tma"), (16, 256, 64, 16, "tma"), (33, 48, 160, 32, "pointer")],
)  # fmt: skip
def test_split_tail_matches_fp64_and_resets_its_counters(m, k, n, block_m, loads):
    torch.manual_seed(1)
    a, b = torch.randn(m, k), torch.randn(k, n)
    cfg = build_config(
        ok.AgGemmConfig,
        "ag_gemm",
        shape_key(1, m, k, n, a.dtype),
        {"block_m": block_m, "loads": loads},
    )
    tiles = -(-m // block_m) * -(-n // cfg.block_n)
    programs = num_sms(torch.device("cpu"))
    assert split_tail(tiles, programs, -(-k // cfg.block_k))[1] > 1, (
        "the case must have a split tail"
    )
    for _ in range(2):  # the second launch finds the counters the first one left
        out = poisoned((m, n), torch.float32, "cpu")
        ok.matmul(a, b, cfg, out=out)
        check_matmul(out, a, b, f"split tail {m}x{k}x{n}")
        _, counters = tail_scratch(torch.device("cpu"), programs, cfg.block_m * cfg.block_n)
        assert not counters.any(), "a split tile's counter was not reset"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "k", "n"), [(2048, 1024, 7168), (4096, 1024, 2560), (256, 1024, 4096)]
)
def test_split_tail_on_gpu(m, k, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", 0)
    cfg = build_config(ok.AgGemmConfig, "ag_gemm", shape_key(1, m, k, n, torch.bfloat16), None)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    assert split_tail(tiles, num_sms(device), -(-k // cfg.block_k))[1] > 1, (
        "the case must have a split tail"
    )
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()
    first = ok.matmul(a, b, out=poisoned((m, n), torch.bfloat16, device))
    check_matmul(first.cpu(), a.cpu(), b.cpu(), f"split tail {m}x{k}x{n}")
    for _ in range(
        3
    ):  # later launches find the counters the earlier ones left; same sums, same bits
        assert torch.equal(ok.matmul(a, b, out=poisoned((m, n), torch.bfloat16, device)), first)
