"""Probe: what the NCCL deadline watchdog (runtime/nccl_watch.py) costs a plain call's host time.

    python -m bench.experiments.probe_plain_watch [--m 16 256]   # 2 GPUs, one rank each (NCCL)

On two ranks, one per GPU, behind a GPU sleep (bench.common.enqueue_timing), at
each M the host time per call of: the pairs the plain paths stand for
(``torch.matmul`` then ``dist.all_reduce`` / ``reduce_scatter_tensor``), gemm_ar's
and gemm_rs's plain paths with their collective watched (the default), the same
with ``timeout_s = inf`` (not watched), and the watch's own steps alone. The
goal: the watched plain path within 10% of the pair.
Median of REPS batches of CALLS calls per rank, then the maximum over ranks.
"""

from __future__ import annotations

import math
import statistics

import torch

K, N = 7168, 8192
CALLS, REPS = 50, 9
SLEEP_CYCLES = 100_000_000  # 50 ms at 2 GHz: outlasts 50 calls of 200 us


def _us(call) -> tuple[float, bool]:
    from bench.common import enqueue_timing

    for _ in range(5):
        call()
    runs = [enqueue_timing(call, CALLS, SLEEP_CYCLES) for _ in range(REPS)]
    return statistics.median(r[0] for r in runs) * 1e3, all(r[2] for r in runs)


def _rank(rank: int, world: int, m: int) -> dict[str, tuple[float, bool]]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.runtime import nccl_watch
    from overlap_kernels.runtime.collectives import backend_of

    group = dist.group.WORLD
    assert backend_of(group) == "nccl", "one rank per GPU: an NCCL group"
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(m, K // world, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, K // world, device=device, dtype=torch.bfloat16).t()
    watched = {"path": "sequential"}
    unwatched = {"path": "sequential", "timeout_s": math.inf}

    def pair():
        dist.all_reduce(torch.matmul(x, w), group=group)

    def pair_rs():
        out = torch.empty(m // world, N, device=device, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, torch.matmul(x, w), group=group)

    watch = nccl_watch.watch()
    calls = {
        "torch.matmul + dist.all_reduce": pair,
        "gemm_ar plain, watched": lambda: ok.gemm_ar(x, w, group, config=watched),
        "gemm_ar plain, timeout_s=inf": lambda: ok.gemm_ar(x, w, group, config=unwatched),
        "torch.matmul + reduce_scatter": pair_rs,
        "gemm_rs plain, watched": lambda: ok.gemm_rs(x, w, group, config=watched),
        "gemm_rs plain, timeout_s=inf": lambda: ok.gemm_rs(x, w, group, config=unwatched),
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
    import argparse

    from overlap_kernels.launch import gpu_count, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[16, 256], help="rows (even)")
    args = p.parse_args()
    if gpu_count() < 2:
        raise SystemExit("needs 2 GPUs: NCCL refuses two ranks on one GPU")
    for m in args.m:
        per_rank = run_ranks(_rank, 2, m, use_gpu=True, gpus=2, timeout_s=600)
        print(f"M = {m}, K = {K} (each rank {K // 2}), N = {N}; max over ranks")
        pair = None
        for name in per_rank[0]:
            us = max(r[name][0] for r in per_rank)
            held = all(r[name][1] for r in per_rank)
            pair = us if name.startswith("torch.matmul") else pair
            print(f"{name:>34}: {us:7.2f} us per call ({us / pair:.3f} x the pair above)"
                  + ("" if held else "  * the sleep ran out: may hold device time"))  # fmt: skip


if __name__ == "__main__":
    main()
