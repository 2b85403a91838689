"""Do decode-size GEMMs stream the weight faster with more programs than SMs?

At M <= 256 the persistent GEMM runs one program per SM; a short wave's tiles are
split along K into at most MAX_TAIL_PIECES pieces (kernels/gemm.py), never into
more programs than SMs. The weight read is the cost, so what matters is how many
bytes are in flight. This probe launches the GEMM core as ``overlap_kernels.matmul``
does (one M-block table, no waits) with ``programs`` = SMs x 1, 2, 3, 4 and the
piece cap at 4 and 8, for a few decode tiles, and times each beside cuBLAS
(do_bench medians, L2 flushed, interleaved rounds), checking each against fp32.
A diagnostic: what it finds goes into the template and ``python -m bench.tune_gemm``.

``python -m bench.experiments.probe_decode_split [--rounds R] [--json PATH]`` (one GPU).
"""

from __future__ import annotations

import itertools

import torch

from bench.experiments import gemm_probe_parser, ranked_against_cublas, working, write_json
from bench.gemm_cores import DENSE_DECODE, _dense, config_name

# (block_m, block_n, block_k, num_warps, num_stages): the template's decode tiles and
# the shallower ones that leave room for two or more programs per SM.
TILES = ((16, 64, 128, 4, 4), (16, 64, 128, 4, 6), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4),
         (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4))  # fmt: skip
PER_SM = (1, 2, 3, 4)
PIECE_CAPS = (4, 8)


def _launcher(p, tile, programs: int, cap: int):
    import overlap_kernels.kernels.gemm as gemm
    from overlap_kernels.kernels.gemm import launch_chunked_gemm, mblock_table
    from overlap_kernels.ops.ag_gemm import AgGemmConfig
    from overlap_kernels.ops.checks import check_tiles_fit

    bm, bn, bk, warps, stages = tile
    cfg = AgGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                       group_m=1, epilogue="pointer").validate()  # fmt: skip
    check_tiles_fit("probe", cfg, p.a.dtype, p.a.device)
    table = mblock_table([(0, p.a.shape[0], -1, 0)], bm, p.a.device)
    p.keep[(tile, programs, cap)] = table

    state = {"again": None}

    def call():  # (a relaunch keeps the first launch's pieces: kernels/relaunch.py)
        again = state["again"]
        if again is not None and again(p.a, p.b, p.out):
            return
        saved, gemm.MAX_TAIL_PIECES = gemm.MAX_TAIL_PIECES, cap
        try:
            state["again"] = launch_chunked_gemm(p.a, p.b, p.out, table, cfg, programs)
        finally:
            gemm.MAX_TAIL_PIECES = saved

    return call


def _units(m: int, n: int, k: int, tile, programs: int, cap: int) -> int:
    """Programs the launch runs (tiles, or tiles x K pieces of a split short wave)."""
    import overlap_kernels.kernels.gemm as gemm

    tiles = -(-m // tile[0]) * -(-n // tile[1])
    saved, gemm.MAX_TAIL_PIECES = gemm.MAX_TAIL_PIECES, cap
    try:
        _, pieces = gemm.split_tail(tiles, programs, -(-k // tile[2]))
    finally:
        gemm.MAX_TAIL_PIECES = saved
    return programs if tiles >= programs else tiles * pieces


def main() -> None:
    import triton

    from overlap_kernels.runtime.platform import num_sms

    parser = gemm_probe_parser(__doc__)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = num_sms(device)
    print(
        f"# {torch.cuda.get_device_name()}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}"
    )
    found = []
    for shape in DENSE_DECODE:
        m, k, n = shape
        p = _dense(shape, device)
        candidates, seen = {}, set()
        for tile, per_sm, cap in itertools.product(TILES, PER_SM, PIECE_CAPS):
            if tile[0] > max(16, triton.next_power_of_2(m)) * 2:
                continue  # far more rows than the problem has
            units = _units(m, n, k, tile, per_sm * sms, cap)
            if (tile, units) in seen:
                continue  # the same launch as one already timed
            seen.add((tile, units))
            name = f"{config_name(dict(zip(('block_m', 'block_n', 'block_k', 'num_warps', 'num_stages'), tile), group_m=1))} x{per_sm} cap{cap} ({units} programs)"
            try:
                candidates[name] = _launcher(p, tile, per_sm * sms, cap)
            except Exception as e:  # noqa: BLE001 (a tile that does not fit is a row, not the end)
                print(f"{shape} {name}: refused ({type(e).__name__}: {e})"[:200])
        calls = {"cublas": p.vendor, **working(p, candidates)}
        found.append(ranked_against_cublas(f"{m}x{k}x{n}", calls, args.rounds, top=8))
    write_json(args.json, found)


if __name__ == "__main__":
    main()
