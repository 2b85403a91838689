"""Ablations of ag_gemm's knobs on the small shapes, and where a call's time goes.

``python -m bench.experiments.ablate_ag_gemm`` (all GPUs). For each shape and variant:
median ms per call back to back (CUDA events, max over ranks), median ms of
one call's device work alone (enqueued behind a GPU sleep, so host gaps do not
count), and median host microseconds to enqueue one call.
A diagnostic for choosing template values; the numbers to quote come from
``python -m bench``.
"""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(2048, 8192, 7168), (4096, 8192, 2560), (1024, 4096, 4096)]
VARIANTS = {  # our GEMM consuming (cuBLAS per chunk needs the copy engine's events)
    "ce": {"gemm": "triton"},
    "ce_direct": {"gemm": "triton", "schedule": "direct"},
    "sm8": {"gemm": "triton", "mechanism": "sm_copy", "comm_sms": 8},
    "sm16": {"gemm": "triton", "mechanism": "sm_copy", "comm_sms": 16},
    "sm32": {"gemm": "triton", "mechanism": "sm_copy", "comm_sms": 32},
}
# A GPU-side sleep long enough for the host to enqueue a whole call behind it,
# so that "gpu alone" times the call's device work without host gaps.
_SLEEP_CYCLES = 3_000_000


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
            alone = []
            for _ in range(10):
                dist.barrier()
                torch.cuda._sleep(_SLEEP_CYCLES)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                ok.ag_gemm(x, w, config=cfg)
                e.record()
                torch.cuda.synchronize()
                alone.append(s.elapsed_time(e))
            ok.raise_if_failed()
            back_to_back = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
            gpu = torch.tensor([back_to_back, statistics.median(alone)], device="cuda")
            dist.all_reduce(gpu, op=dist.ReduceOp.MAX)
            lines.append(
                f"{m}x{k}x{n} {name:<10} back-to-back {gpu[0].item():.3f} ms  "
                f"gpu alone {gpu[1].item():.3f} ms  host {statistics.median(host):.0f} us"
            )
    return lines


def main() -> None:
    from overlap_kernels.launch import run_ranks

    print("\n".join(run_ranks(_rank, torch.cuda.device_count(), use_gpu=True, timeout_s=400)[0]))


if __name__ == "__main__":
    main()
