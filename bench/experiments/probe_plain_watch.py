"""Probe: what the NCCL deadline watchdog (runtime/nccl_watch.py) costs a plain call's host time.

    python -m bench.experiments.probe_plain_watch        # 2 GPUs, one rank each (NCCL)

On two ranks, one per GPU, behind a GPU sleep (bench.common.enqueue_timing), the
host time per call of: the pair the plain path stands for (``torch.matmul`` then
``dist.all_reduce``), gemm_ar's plain path with its collective watched (the
default), and the same with ``timeout_s = inf`` (not watched); and the watch's
own steps alone. The goal: the watched plain path within 10% of the pair.
Median of REPS batches of CALLS calls per rank, then the maximum over ranks.
"""

from __future__ import annotations

import math
import statistics

import torch

M, K, N = 16, 7168, 8192
CALLS, REPS = 50, 9
SLEEP_CYCLES = 100_000_000  # 50 ms at 2 GHz: outlasts 50 calls of 200 us


def _us(call) -> tuple[float, bool]:
    from bench.common import enqueue_timing

    for _ in range(5):
        call()
    runs = [enqueue_timing(call, CALLS, SLEEP_CYCLES) for _ in range(REPS)]
    return statistics.median(r[0] for r in runs) * 1e3, all(r[2] for r in runs)


def _rank(rank: int, world: int, use_gpu: bool) -> dict[str, tuple[float, bool]]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.runtime import nccl_watch
    from overlap_kernels.runtime.collectives import backend_of

    group = dist.group.WORLD
    assert backend_of(group) == "nccl", "one rank per GPU: an NCCL group"
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(M, K // world, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, K // world, device=device, dtype=torch.bfloat16).t()
    watched = {"path": "sequential"}
    unwatched = {"path": "sequential", "timeout_s": math.inf}

    def pair():
        dist.all_reduce(torch.matmul(x, w), group=group)

    watch = nccl_watch.watch()
    calls = {
        "torch.matmul + dist.all_reduce": pair,
        "gemm_ar plain, watched": lambda: ok.gemm_ar(x, w, group, config=watched),
        "gemm_ar plain, timeout_s=inf": lambda: ok.gemm_ar(x, w, group, config=unwatched),
        "watch.check + watch.note alone": lambda: (
            watch.check(group),
            watch.note("probe", "nothing", group, 30.0, device.index),
        ),
    }
    out = {}
    for name, call in calls.items():
        dist.barrier()
        out[name] = _us(call)
    torch.cuda.synchronize()
    ok.raise_if_failed(group)
    return out


def main() -> None:
    from overlap_kernels.launch import gpu_count, run_ranks

    if gpu_count() < 2:
        raise SystemExit("needs 2 GPUs: NCCL refuses two ranks on one GPU")
    per_rank = run_ranks(_rank, 2, True, use_gpu=True, gpus=2, timeout_s=600)
    pair = max(r["torch.matmul + dist.all_reduce"][0] for r in per_rank)
    for name in per_rank[0]:
        us = max(r[name][0] for r in per_rank)
        held = all(r[name][1] for r in per_rank)
        print(f"{name:>34}: {us:7.2f} us per call ({us / pair:.3f} x the pair)"
              + ("" if held else "  * the sleep ran out: may hold device time"))  # fmt: skip


if __name__ == "__main__":
    main()
