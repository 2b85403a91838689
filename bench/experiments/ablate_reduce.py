"""Where does a gemm_rs / gemm_ar call spend its time? A diagnostic, not the benchmark.

``python -m bench.experiments.ablate_reduce [--profile] [--only TEXT]`` (one process per GPU, spawned
here; ``--only`` keeps the cases whose label contains TEXT) prints,
per case, three times per call (ms, max over ranks):

    host     enqueueing one call while the GPU is busy (behind a sleep kernel), so
             no call waits for the device: the host work alone;
    device   the same calls run back to back on the device (events around them,
             recorded behind the sleep): the device work alone;
    b2b      calls back to back from an idle GPU, as the benchmark times them: the
             larger of the two when nothing else is wrong.

Cases marked "bind" launch through Triton's full argument binding every call
(kernels/relaunch.py disabled), to show what the relaunch saves. ``--profile`` adds
rank 0's cProfile of the one_shot M=16 call (top functions by own time). Rank 0
also prints the registers and spills of every compiled reduce GEMM.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import enqueue_ms, profile_text

# The decode tiles of templates/gemm_ar.toml at M=16, for our GEMM core alone.
DECODE_16 = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 6, "group_m": 1,
             "split_tail": False}  # fmt: skip
_ONE_SHOT_256_TILES = (
    (128, 256, 64, 8, 3),  # the [cuda] section's tiles
    (128, 128, 64, 8, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (32, 128, 128, 4, 5),
)


def _tiles(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    return {"path": "one_shot", "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
            "num_stages": stages, "group_m": 1}  # fmt: skip


CASES = [
    # (label, op, M, K, N, config; None: the sequential pair torch.matmul + all_reduce;
    # op "matmul" is our GEMM core alone, "torch.matmul" cuBLAS alone)
    ("cublas 16", "torch.matmul", 16, 7168, 8192, None),
    ("our gemm 16", "matmul", 16, 7168, 8192, DECODE_16),
    ("seq 16", "gemm_ar", 16, 7168, 8192, None),
    ("one_shot 16", "gemm_ar", 16, 7168, 8192, {"path": "one_shot"}),
    ("one_shot 16 bind", "gemm_ar", 16, 7168, 8192, {"path": "one_shot", "bind": True}),
    ("one_shot 16 pointer", "gemm_ar", 16, 7168, 8192, {"path": "one_shot", "epilogue": "pointer"}),
    ("seq 64", "gemm_ar", 64, 7168, 8192, None),
    ("one_shot 64", "gemm_ar", 64, 7168, 8192, {"path": "one_shot"}),
    ("one_shot 64 pointer", "gemm_ar", 64, 7168, 8192, {"path": "one_shot", "epilogue": "pointer"}),
    ("seq 256", "gemm_ar", 256, 7168, 8192, None),
    ("one_shot 256", "gemm_ar", 256, 7168, 8192, {"path": "one_shot"}),
    (
        "one_shot 256 pointer",
        "gemm_ar",
        256,
        7168,
        8192,
        {"path": "one_shot", "epilogue": "pointer"},
    ),
    # one_shot at M=256 by tile: one wave of 128x128 tiles pushes every partial at the end
    *(
        (
            f"one_shot 256 {bm}x{bn}x{bk} w{warps} s{stages}",
            "gemm_ar",
            256,
            7168,
            8192,
            _tiles(bm, bn, bk, warps, stages),
        )
        for bm, bn, bk, warps, stages in _ONE_SHOT_256_TILES
    ),
    ("seq 2048", "gemm_ar", 2048, 7168, 8192, None),
    ("two_shot 2048", "gemm_ar", 2048, 7168, 8192, {"path": "two_shot"}),
    ("rs seq 4096x2048", "gemm_rs", 4096, 2048, 8192, None),
    ("rs push 4096x2048", "gemm_rs", 4096, 2048, 8192, {"path": "fused"}),
]
CALLS = 50
SLEEP_CYCLES = 200_000_000  # ~0.1 s at H200 clocks: longer than enqueueing CALLS calls


def _sequential(op: str, x, w):
    import torch.distributed as dist

    def call():
        product = torch.matmul(x, w)
        if op == "gemm_ar":
            dist.all_reduce(product)
            return product
        out = product.new_empty(product.shape[0] // dist.get_world_size(), product.shape[1])
        dist.reduce_scatter_tensor(out, product)
        return out

    return call


def _times(call) -> tuple[float, float, float]:
    """(host, device, back-to-back) ms per call."""
    import torch.distributed as dist

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    host, device = enqueue_ms(call, CALLS, SLEEP_CYCLES)
    dist.barrier()
    begin = time.perf_counter()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - begin) * 1e3 / CALLS
    return host, device, b2b


def _body(rank: int, world: int, profile: bool, only: str) -> list:
    import overlap_kernels as ok
    from overlap_kernels.kernels import reduce_gemm
    from overlap_kernels.kernels.relaunch import Relaunch

    rows = []
    relaunch = Relaunch.__call__
    for label, op, m, k, n, cfg in CASES:
        if only not in label:
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        cfg = dict(cfg) if cfg is not None else None
        bind = cfg is not None and cfg.pop("bind", False)
        if op == "torch.matmul":
            call = lambda x=x, w=w: torch.matmul(x, w)
        elif cfg is None:
            call = _sequential(op, x, w)
        else:
            fn = getattr(ok, op)
            call = lambda fn=fn, x=x, w=w, cfg=cfg: fn(x, w, config=cfg)
        Relaunch.__call__ = (lambda self, **changed: False) if bind else relaunch
        try:
            rows.append((label, *_times(call)))
            if profile and label in ("one_shot 16", "one_shot 16 bind"):
                report = profile_text(call)  # every rank calls: the op is collective
                if rank == 0:
                    rows.append((label, report))
        finally:
            Relaunch.__call__ = relaunch
    if rank == 0:
        for device_cache in reduce_gemm.reduce_gemm_kernel.device_caches.values():
            for kernel in device_cache[0].values():
                meta = kernel.metadata
                line = (f"reduce_gemm_kernel {meta.num_warps} warps, shared {meta.shared} B: "
                        f"regs {kernel.n_regs}, spills {kernel.n_spills}")  # fmt: skip
                rows.append(("regs", line))
    return rows


def main() -> None:
    from overlap_kernels.launch import gpu_count, run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", action="store_true", help="rank 0's cProfile of one_shot at M=16"
    )
    parser.add_argument("--only", default="", help="only the cases whose label contains this text")
    args = parser.parse_args()
    results = run_ranks(_body, gpu_count(), args.profile, args.only, use_gpu=True, timeout_s=400)
    print(
        f"{'case':<24} {'host':>8} {'device':>8} {'b2b':>8}   ms per call, max over {len(results)} ranks"
    )
    timed = [{row[0]: row[1:] for row in rows if len(row) == 4} for rows in results]
    for row in results[0]:
        if len(row) == 2:  # a profile or a kernel's registers
            print(row[1])
            continue
        worst = [max(times[row[0]][j] for times in timed) for j in range(3)]
        print(f"{row[0]:<24} {worst[0]:8.3f} {worst[1]:8.3f} {worst[2]:8.3f}")


if __name__ == "__main__":
    main()
