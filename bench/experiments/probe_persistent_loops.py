"""Does the persistent GEMM gain from a pipelined tile loop: flattened, or warp-specialised?

Our GEMM core (kernels/gemm.py) pipelines only its K loop: the tile loop around
it holds the chunk waits, which must stay ahead of every load of their tile.
So a tile's epilogue and the next tile's first loads never overlap. Triton
3.6 can overlap them on sm_90 in two ways, both asked of the tile loop
(``tl.range``): ``flatten`` fuses the two loops into one software-pipelined
loop, ``warp_specialize`` gives the loads and the MMAs warps of their own
(Hopper's warp specialisation pass, which triton 3.6 applies only to kernels
of 4 warps: it adds a loading warpgroup and a second MMA warpgroup, 12 warps
in all). Warp specialisation may also be asked of the K loop alone, which
would leave the tile loop free to hold waits.

The probe's matmul runs our tile order with its tile loop nested (as ours),
flattened, or warp-specialised, or its K loop warp-specialised; and, with
the chunked GEMM's wait code in the tile loop (no flag to wait for), nested
or with its K loop warp-specialised. Each stores its tiles by pointers, by
whole-tile TMA stores, or by TMA stores of two column halves (half the
shared memory for the store). Every variant that runs and is right (against
fp32) is timed beside cuBLAS and ``overlap_kernels.matmul`` (do_bench
medians, L2 flushed, interleaved rounds).

``python -m bench.experiments.probe_persistent_loops [--rounds R] [--json PATH]``
(one GPU); ``--compile-only`` builds every variant, and the warp-specialised
loops at 8 warps too, for sm_90 on a machine with no GPU and says which the
compiler warp-specialised.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import overlap_kernels  # noqa: F401  (first: it decides whether Triton interprets)

# isort: split
import triton
import triton.language as tl

from overlap_kernels.kernels.gemm import _grouped_tile, _store_tile, _tile_rows, operand_descriptors

# (block_m, block_n, block_k, num_stages, num_warps): the template's prefill tile and a
# narrower one; warp-specialised loops at 4 warps, the only count the pass takes.
TILES = {"nested": ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8)),
         "flatten": ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8)),
         "ws_tiles": ((128, 256, 64, 3, 4), (128, 128, 64, 4, 4)),
         "ws_k": ((128, 256, 64, 3, 4), (128, 128, 64, 4, 4)),
         # the K loop warp-specialised under a tile loop holding the chunked GEMM's waits
         "ws_k_waits": ((128, 256, 64, 3, 4), (128, 128, 64, 4, 4)),
         "nested_waits": ((128, 256, 64, 3, 8),)}  # fmt: skip
# Built by --compile-only only: at 8 warps the pass leaves the kernel as it is.
COMPILE_ONLY_TILES = {"ws_tiles": ((128, 256, 64, 3, 8),), "ws_k": ((128, 256, 64, 3, 8),)}
EPILOGUES = ("pointer", "tma", "tma_halves")
GROUP_M = 8


@triton.jit
def probe_matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    mblocks_ptr, chunk_flags_ptr, epoch, err_addr, budget,  # WAITS: as the chunked GEMM's
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS_TILES: tl.constexpr,
    WS_K: tl.constexpr, WAITS: tl.constexpr, EPILOGUE: tl.constexpr,
):  # fmt: skip
    # B stored [N, K] (nn.Linear's weight), read as [K, N].
    a_desc, b_desc = operand_descriptors(
        a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, True, False
    )
    store_n: tl.constexpr = BLOCK_N // 2 if EPILOGUE == "tma_halves" else BLOCK_N
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, store_n])
    num_mblocks = tl.cdiv(M, BLOCK_M)
    num_nblocks = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_mblocks * num_nblocks, NUM_PROGRAMS,
                         flatten=FLATTEN, warp_specialize=WS_TILES):  # fmt: skip
        if WAITS:  # the chunked GEMM's tile start: its M-block's row, after its chunk's wait
            row, row_stop, col, budget = _tile_rows(
                tile, num_mblocks, num_nblocks, num_mblocks, mblocks_ptr, chunk_flags_ptr, epoch,
                err_addr, budget, GROUP, BLOCK_N, True,
            )  # fmt: skip
        else:
            mblock, nblock = _grouped_tile(tile, num_mblocks, num_nblocks, num_mblocks, GROUP)
            row, col = mblock * BLOCK_M, nblock * BLOCK_N
            row_stop = tl.minimum(row + BLOCK_M, M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in tl.range(k_tiles, warp_specialize=WS_K):
            a = a_desc.load([row, kt * BLOCK_K])
            b = b_desc.load([col, kt * BLOCK_K]).T
            acc = tl.dot(a, b, acc)
        if EPILOGUE == "pointer":
            _store_tile(c_ptr, row, row_stop, col, N, N, acc, BLOCK_M, BLOCK_N, False)
        elif EPILOGUE == "tma_halves":
            left, right = tl.split(
                tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            )
            c_desc.store([row, col], left.to(c_ptr.dtype.element_ty))
            c_desc.store([row, col + BLOCK_N // 2], right.to(c_ptr.dtype.element_ty))
        else:
            c_desc.store([row, col], acc.to(c_ptr.dtype.element_ty))


def _variants(tiles_of=TILES):
    """(tile, loop, epilogue) of every variant of ``tiles_of``."""
    for loop, tiles in tiles_of.items():
        for tile, epilogue in itertools.product(tiles, EPILOGUES):
            yield tile, loop, epilogue


def _constexprs(tile, loop: str, epilogue: str, programs: int) -> dict:
    bm, bn, bk, _, _ = tile
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP": GROUP_M,
            "NUM_PROGRAMS": programs, "FLATTEN": loop == "flatten", "WS_TILES": loop == "ws_tiles",
            "WS_K": loop.startswith("ws_k"), "WAITS": loop.endswith("_waits"), "EPILOGUE": epilogue}  # fmt: skip


def _name(tile, loop: str, epilogue: str) -> str:
    bm, bn, bk, stages, warps = tile
    return f"{bm}x{bn}x{bk} s{stages} w{warps} {loop} {epilogue}"


def compile_only() -> None:
    """Build every variant for sm_90 (no GPU needed) and report what the compiler made."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        # Without a GPU overlap_kernels turned the interpreter on before the kernel was
        # decorated: build it in a process where Triton compiles.
        env = dict(os.environ, TRITON_INTERPRET="0")
        argv = [sys.executable, "-m", "bench.experiments.probe_persistent_loops", "--compile-only"]
        sys.exit(subprocess.call(argv, env=env))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = probe_matmul_kernel
    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "mblocks_ptr": "*i32", "chunk_flags_ptr": "*i32", "epoch": "i32", "err_addr": "i64",
                 "budget": "i64"}  # fmt: skip
    for tile, loop, epilogue in itertools.chain(_variants(), _variants(COMPILE_ONLY_TILES)):
        consts = _constexprs(tile, loop, epilogue, 132)
        sig = dict(signature, **dict.fromkeys(consts, "constexpr"))
        try:
            built = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                                   options={"num_stages": tile[3], "num_warps": tile[4]})  # fmt: skip
        except Exception as e:  # noqa: BLE001 (a variant the compiler refuses is a row, not the end)
            print(f"{_name(tile, loop, epilogue):40s} refused: {type(e).__name__}: {str(e)[:160]}")
            continue
        ttgir, ptx = built.asm["ttgir"], built.asm["ptx"]
        print(f"{_name(tile, loop, epilogue):40s} shared {built.metadata.shared:7d}  "
              f"warps {built.metadata.num_warps}  warp_specialize {'ttg.warp_specialize' in ttgir}  "
              f"setmaxnreg {ptx.count('setmaxnreg')}  wgmma {ptx.count('wgmma.mma_async')}")  # fmt: skip


def main() -> None:
    from bench.experiments import gemm_probe_parser

    parser = gemm_probe_parser(__doc__)
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90, no GPU")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return

    import torch

    import overlap_kernels as ok
    from bench.experiments import ranked_against_cublas, working, write_json
    from bench.gemm_cores import DENSE, _dense
    from overlap_kernels.kernels.gemm import mblock_table
    from overlap_kernels.kernels.relaunch import ensure_descriptor_allocator
    from overlap_kernels.runtime.platform import num_sms

    device = torch.device("cuda")
    sms = num_sms(device)
    ensure_descriptor_allocator()
    flags = torch.zeros(64, dtype=torch.int32, device=device)
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    found = []
    for m, k, n in DENSE:
        p = _dense((m, k, n), device)
        candidates = {}
        for tile, loop, epilogue in _variants():
            programs = min(sms, -(-m // tile[0]) * -(-n // tile[1]))
            # (the waits' table: one chunk, no flag to wait for, as overlap_kernels.matmul's)
            table = p.keep.setdefault(tile[0], mblock_table([(0, m, -1, 0)], tile[0], device))
            candidates[_name(tile, loop, epilogue)] = _launcher(
                p, tile, loop, epilogue, programs, table, flags
            )
        calls = {
            "cublas": p.vendor,
            "overlap_kernels.matmul": lambda p=p: ok.matmul(p.a, p.b, out=p.out),
        }
        calls.update(working(p, candidates))
        found.append(ranked_against_cublas(f"{m}x{k}x{n}", calls, args.rounds))
    write_json(args.json, found)


def _launcher(p, tile, loop: str, epilogue: str, programs: int, table, flags):
    """The call of one variant on problem ``p`` (weight in nn.Linear layout: B stored [N, K])."""
    consts = _constexprs(tile, loop, epilogue, programs)
    (m, k), n = p.a.shape, p.b.shape[1]
    weight = p.b.t()

    def call():
        probe_matmul_kernel[(programs,)](p.a, weight, p.out, m, n, k, table, flags, 0, 0, 1 << 40,
                                         **consts, num_stages=tile[3], num_warps=tile[4])  # fmt: skip

    return call


if __name__ == "__main__":
    main()
