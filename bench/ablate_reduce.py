"""Where does a gemm_rs / gemm_ar call spend its time? A diagnostic, not the benchmark.

``python -m bench.ablate_reduce`` (one process per GPU, spawned here) prints, per case:
host time to enqueue one call, device time per call back to back (CUDA events over 20
calls), and on rank 0 the registers and spills of the compiled reduce GEMM.
"""

from __future__ import annotations

import time

import torch

CASES = [
    # (label, op, M, K, N, config)
    ("rs push 8192", "gemm_rs", 8192, 7168, 8192, {"path": "fused"}),
    ("rs push 8192 128x128", "gemm_rs", 8192, 7168, 8192, {"path": "fused", "block_n": 128}),
    ("rs push 8192 64x256 w4", "gemm_rs", 8192, 7168, 8192, {"path": "fused", "block_m": 64, "num_warps": 4}),
    ("rs push 8192 tma", "gemm_rs", 8192, 7168, 8192, {"path": "fused", "epilogue": "tma"}),
    ("ar one_shot 16 tma", "gemm_ar", 16, 7168, 8192, {"path": "one_shot", "epilogue": "tma"}),
    ("ar two_shot 2048 tma", "gemm_ar", 2048, 7168, 8192, {"path": "two_shot", "epilogue": "tma"}),
    ("ar one_shot 16", "gemm_ar", 16, 7168, 8192, {"path": "one_shot"}),
    ("ar two_shot 2048", "gemm_ar", 2048, 7168, 8192, {"path": "two_shot"}),
    ("matmul 8192", "matmul", 8192, 7168, 8192, {}),
]


def _body(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.kernels import reduce_gemm

    lines = []
    for label, op, m, k, n, cfg in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        if op == "matmul":
            call = lambda: ok.matmul(x, w)  # noqa: E731
        else:
            fn = getattr(ok, op)
            call = lambda: fn(x, w, config=cfg)  # noqa: E731
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        begin = time.perf_counter()
        call()
        host_ms = (time.perf_counter() - begin) * 1e3
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            call()
        stop.record()
        torch.cuda.synchronize()
        lines.append(f"{label:<26} host {host_ms:7.3f} ms/call   device {start.elapsed_time(stop) / 20:7.3f} ms/call")
    if rank == 0:
        for device_cache in reduce_gemm.reduce_gemm_kernel.device_caches.values():
            for kernel in device_cache[0].values():
                meta = kernel.metadata
                lines.append(f"reduce_gemm_kernel {meta.num_warps} warps, shared {meta.shared} B: "
                             f"regs {kernel.n_regs}, spills {kernel.n_spills}")  # fmt: skip
    return lines


def main() -> None:
    from overlap_kernels.launch import gpu_count, run_ranks

    results = run_ranks(_body, gpu_count(), use_gpu=True, timeout_s=300)
    for rank, lines in enumerate(results):
        print(f"--- rank {rank}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
