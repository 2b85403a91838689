"""Is one rank the slow one? ag_gemm against PyTorch's fused op, rank by rank.

The benchmark reports the maximum over ranks of each variant's median. At
16384x8192x7168 PyTorch's fused op stays 3-5% ahead of ours although rank 0's
device span was shorter for ours (docs/performance.md, ag_gemm). This probe prints, for
each rank, the median of single calls timed back to back (as the benchmark
times them) and the period of a block of calls (first start to last end, per
call), both interleaved in rounds, for PyTorch's op and ours (its default
config; the first call measures). A diagnostic; the numbers to quote come
from ``python -m bench``.

``python -m bench.experiments.probe_ag_ranks [--more] [--nccl]`` (all GPUs; ``--more``
interleaves two of the benchmark's other variants of ours between them,
``--nccl`` its NCCL all-gather alone and the plain pair: the benchmark's
context, piece by piece, for a deficit the probe alone does not show).
"""

from __future__ import annotations

import statistics

import torch

from bench.harness import CudaClock, call_marks

SHAPES = [(16384, 8192, 7168), (8192, 8192, 7168)]  # (gathered M, K, N)
_ROUNDS, _CALLS, _WARMUP = 6, 10, 5


def _timed_block(fn) -> tuple[list[float], float]:
    """Per-call ms of ``_CALLS`` calls back to back, and the block's period per call."""
    clock = CudaClock()
    marks = call_marks(fn, _CALLS, clock)
    *calls, block = clock.elapsed_ms([*marks, (marks[0][0], marks[-1][1])])
    return calls, block / _CALLS


def _rank(rank: int, world: int, interleave_more: bool, interleave_nccl: bool) -> list[tuple]:
    import itertools

    import torch.distributed as dist
    import torch.distributed._symmetric_memory  # registers torch.ops.symm_mem

    import overlap_kernels as ok
    from bench.common import enable_symm_mem
    from overlap_kernels.runtime.collectives import all_gather_single

    group_name = dist.group.WORLD.group_name
    enable_symm_mem(group_name)
    rows = []
    for m, k, n in SHAPES:
        sets = [(torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()) for _ in range(2)]  # fmt: skip
        cycle = itertools.cycle(sets)

        def torch_fused(cycle=cycle):
            x, w = next(cycle)
            return torch.ops.symm_mem.fused_all_gather_matmul(
                x, [w], 0, group_name, return_A=False
            )[1][0]

        def ours(cycle=cycle):
            x, w = next(cycle)
            return ok.ag_gemm(x, w)

        def ours_with(config, cycle=cycle):
            return lambda: ok.ag_gemm(*next(cycle), config=config)

        variants = {"torch_fused": torch_fused, "ours_auto": ours}
        if interleave_more:  # some of the benchmark's other variants between them
            variants["ours_triton"] = ours_with({"gemm": "triton"})
            variants["ours_cublas_1s"] = ours_with({"gemm": "cublas", "cublas_streams": 1})
        if interleave_nccl:  # the benchmark's NCCL variants between them
            gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)

            def nccl_all_gather(cycle=cycle, gathered=gathered):
                return all_gather_single(gathered, next(cycle)[0])

            def sequential(cycle=cycle, gathered=gathered):
                x, w = next(cycle)
                all_gather_single(gathered, x)
                return torch.matmul(gathered, w)

            variants["nccl_all_gather"], variants["sequential"] = nccl_all_gather, sequential
        for fn in variants.values():
            for _ in range(_WARMUP):
                fn()
        calls = {name: [] for name in variants}
        periods = {name: [] for name in variants}
        for r in range(_ROUNDS):
            for name in list(variants)[:: 1 if r % 2 else -1]:
                dist.barrier()
                torch.cuda.synchronize()
                times, period = _timed_block(variants[name])
                calls[name] += times
                periods[name].append(period)
        for name in variants:
            rows.append(
                (
                    f"{m}x{k}x{n}",
                    name,
                    rank,
                    statistics.median(calls[name]),
                    statistics.median(periods[name]),
                )
            )
    return rows


def main() -> None:
    import sys

    from overlap_kernels.launch import run_ranks

    more, nccl = "--more" in sys.argv[1:], "--nccl" in sys.argv[1:]
    results = run_ranks(_rank, torch.cuda.device_count(), more, nccl, use_gpu=True, timeout_s=400)
    print(
        f"{'shape':<16} {'variant':<15} {'rank':>4} {'call median':>12} {'block period':>13}   ms"
    )
    for row in sorted((row for rows in results for row in rows), key=lambda r: (r[0], r[1], r[2])):
        print(f"{row[0]:<16} {row[1]:<15} {row[2]:>4} {row[3]:12.3f} {row[4]:13.3f}")


if __name__ == "__main__":
    main()
