"""How fast can a Triton kernel stream a decode GEMM's weight, with no product at all?

At M = 1-64 the weight read is a decode GEMM's whole cost: our best tiles read a
7168x8192 bf16 weight at ~2.7 TB/s and cuBLAS at ~2.9 (docs/performance.md, the
GEMM cores). This probe times kernels that only read it, in the GEMM's access
pattern (each program a block of weight rows, over a range of K, tile by tile),
and sum it so nothing is optimised away: TMA or pointer loads, tile sizes, warps,
stages and K splits. Beside them: cuBLAS's decode GEMM (M = 1 and 16),
``torch.sum`` of the weight, and the same loop with the product in it (one program per
block of weight rows, nothing else of our GEMM's). If the best read runs near cuBLAS's rate, the decode
GEMM is at the read's bound on this GPU; if well above, the GEMM's tile loop
leaves bandwidth unused.

``python -m bench.experiments.probe_weight_stream [--rounds R] [--json PATH]`` (one GPU).
"""

from __future__ import annotations

import itertools
import statistics

import torch
import triton
import triton.language as tl

from bench.experiments import gemm_probe_parser, working, write_json

K, N = 7168, 8192  # a Llama-3-70B-like decode weight, nn.Linear layout [N, K]
# (block_n, block_k, num_warps, num_stages)
TILES = ((64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4),
         (32, 256, 4, 6), (64, 64, 4, 8))  # fmt: skip
SPLITS = (1, 2, 4)
LOADS = ("tma", "pointer")


@triton.jit
def stream_kernel(w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Program (n, s) sums weight rows [n * BLOCK_N, +BLOCK_N) over the s-th of SPLIT
    equal K ranges, tile by tile, into out[n * SPLIT + s]."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    first, stop = piece * k_tiles // SPLIT, (piece + 1) * k_tiles // SPLIT
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    if TMA:
        desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kt in tl.range(first, stop, num_stages=NUM_STAGES):
        if TMA:
            tile = desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
        else:
            k = kt * BLOCK_K + cols
            tile = tl.load(w_ptr + rows[:, None] * K + k[None, :],
                           mask=(rows[:, None] < N) & (k[None, :] < K), other=0.0)  # fmt: skip
        acc += tile.to(tl.float32)
    tl.store(out_ptr + pid_n * SPLIT + piece, tl.sum(acc))


@triton.jit
def decode_gemm_kernel(x_ptr, w_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The same loop with the product in it: program n computes c[:, n-block] = x @ w[n-block].T
    (M <= BLOCK_M; TMA or pointer loads), with nothing else of our GEMM's (no tile table, no waits)."""
    pid_n = tl.program_id(0)
    rows, cols = tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        if TMA:
            a = x_desc.load([0, kt * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K]).T
        else:
            k = kt * BLOCK_K + ks
            a = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                        mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(w_ptr + cols[None, :] * K + k[:, None],
                        mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip


def decode_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, block_m: int, tile: tuple,
                load: str = "tma"):  # fmt: skip
    """out = x @ weight.T by decode_gemm_kernel, one program per block_n weight rows."""
    block_n, block_k, warps, stages = tile
    (m, k), n = x.shape, weight.shape[0]
    decode_gemm_kernel[(triton.cdiv(n, block_n),)](x, weight, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n,
                                                   BLOCK_K=block_k, NUM_STAGES=stages, TMA=load == "tma",
                                                   num_warps=warps)  # fmt: skip


def stream(weight: torch.Tensor, out: torch.Tensor, tile: tuple, split: int, load: str):
    """Launch stream_kernel over ``weight`` [N, K]; ``out`` holds N / block_n x split sums."""
    block_n, block_k, warps, stages = tile
    n, k = weight.shape
    grid = (triton.cdiv(n, block_n), split)
    stream_kernel[grid](weight, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                        SPLIT=split, TMA=load == "tma", num_warps=warps)  # fmt: skip


def _sums_agree(
    weight: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, split: int
) -> bool:
    """Every program's sum matches its block's (float64), within the fp32 rounding of
    at most a few hundred additions per value (1e-5 of the block's absolute sum): a
    missed or twice-read tile is off by far more."""
    n, k = weight.shape
    k_tiles = triton.cdiv(k, block_k)
    w, sums = weight.double(), out.double().tolist()
    for nb, piece in itertools.product(range(triton.cdiv(n, block_n)), range(split)):
        first, stop = piece * k_tiles // split * block_k, (piece + 1) * k_tiles // split * block_k
        block = w[nb * block_n : (nb + 1) * block_n, first:stop]
        if abs(sums[nb * split + piece] - block.sum().item()) > 1e-5 * block.abs().sum().item():
            return False
    return True


def main() -> None:
    from bench.gemm_cores import _dense, interleaved_medians

    args = gemm_probe_parser(__doc__).parse_args()
    device = torch.device("cuda")
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device)
    )
    print(
        f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"
    )
    # Two problems (M = 1 and 16) of the same weight shape; the read alone streams the first's.
    problems = [_dense((m, K, N), device) for m in (1, 16)]
    weight = problems[0].b.t()  # [N, K], contiguous
    calls = {f"cublas {p.a.shape[0]}xKxN": p.vendor for p in problems}
    calls["torch.sum"] = lambda: weight.sum(dtype=torch.float32)
    for tile, split, load in itertools.product(TILES, SPLITS, LOADS):
        out = torch.empty(triton.cdiv(N, tile[0]) * split, device=device, dtype=torch.float32)
        name = f"{load} {tile[0]}x{tile[1]}w{tile[2]}s{tile[3]} split{split}"
        call = (lambda out=out, tile=tile, split=split, load=load:
                stream(weight, out, tile, split, load))  # fmt: skip
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (a tile the compiler refuses is a row)
            print(f"{name}: refused ({type(e).__name__}: {str(e)[:120]})")
            continue
        if not _sums_agree(weight, out, tile[0], tile[1], split):
            print(f"{name}: WRONG sum")
            continue
        calls[name] = call
    for p in problems:
        products = {
            f"gemm {p.a.shape[0]}xKxN {load} {tile[0]}x{tile[1]}w{tile[2]}s{tile[3]}":
                (lambda p=p, tile=tile, load=load: decode_gemm(p.a, p.b.t(), p.out, 16, tile, load))
            for tile, load in itertools.product(TILES, LOADS)
        }  # fmt: skip
        calls.update(working(p, products))
    times, errors = interleaved_medians(calls, args.rounds)
    for name, error in errors.items():
        print(f"{name}: failed while timed ({error})")
    nbytes = weight.numel() * weight.element_size()
    ranked = sorted((statistics.median(t), name) for name, t in times.items())
    print(f"\nreading a {N}x{K} bf16 weight ({nbytes / 1e6:.1f} MB), fastest first")
    for ms, name in ranked:
        print(f"  {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  {name}")
    write_json(
        args.json,
        [{"weight": [N, K], "ms": {name: statistics.median(t) for name, t in times.items()}}],
    )


if __name__ == "__main__":
    main()
