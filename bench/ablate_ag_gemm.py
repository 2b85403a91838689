"""Ablations of ag_gemm's knobs on the small shapes, and the host time of one call.

``python -m bench.ablate_ag_gemm`` (all GPUs). For each shape and variant:
median GPU ms per call (CUDA events around 30 back-to-back calls, max over
ranks) and median host microseconds to enqueue one call (no synchronisation).
A diagnostic for choosing template values; the numbers to quote come from
``python -m bench``.
"""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(4096, 8192, 2560), (2048, 8192, 7168), (8192, 8192, 7168)]
VARIANTS = {
    "ce": {},
    "ce_pieces2": {"pieces": 2},
    "ce_direct": {"schedule": "direct"},
    "sm8": {"mechanism": "sm_copy", "comm_sms": 8},
    "sm16_pieces2": {"mechanism": "sm_copy", "comm_sms": 16, "pieces": 2},
    "ce_stages4": {"num_stages": 4},
}


def _rank(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import overlap_kernels as ok

    lines = []
    for m, k, n in SHAPES:
        x = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        for name, extra in VARIANTS.items():
            cfg = {"path": "fused", **extra}
            for _ in range(5):
                ok.ag_gemm(x, w, config=cfg)
            torch.cuda.synchronize()
            dist.barrier()
            host, starts, ends = [], [], []
            for _ in range(30):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                t = time.perf_counter()
                ok.ag_gemm(x, w, config=cfg)
                host.append((time.perf_counter() - t) * 1e6)
                e.record()
                starts.append(s)
                ends.append(e)
            torch.cuda.synchronize()
            ok.raise_if_failed()
            gpu = torch.tensor([statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))], device="cuda")
            dist.all_reduce(gpu, op=dist.ReduceOp.MAX)
            lines.append(f"{m}x{k}x{n} {name:<14} gpu {gpu.item():.3f} ms  host {statistics.median(host):.0f} us")
    return lines


def main() -> None:
    from overlap_kernels.launch import run_ranks

    print("\n".join(run_ranks(_rank, torch.cuda.device_count(), use_gpu=True, timeout_s=400)[0]))


if __name__ == "__main__":
    main()
