"""Are gemm_ar's decode calls bound by the host? Host time against device time.

At decode sizes (M <= 256, K = 7168, N = 8192) the benchmark's per-call
medians of the plain pair and of one_shot move by 30-100% between runs and
between variants of one run (docs/performance.md, "How to read the numbers"), while the device time of
one_shot measured alone is below the pair's. This probe prints, for each
rank and variant: the per-call median as the benchmark times it (blocks of
calls back to back after a barrier), the host time per call (wall time to
enqueue a block of calls, before the device catches up) and the device's
period per call over the same block (first start to last end). A call whose
host time exceeds its period is host-bound, and its benchmark time is the
host's. Rank 0 then prints where one_shot's host time goes (cProfile).
A diagnostic; the numbers to quote come from ``python -m bench``.

``python -m bench.experiments.probe_decode`` (all GPUs).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import enqueue_ms, profile_text
from bench.harness import CudaClock, call_marks

SHAPES = [(16, 7168, 8192), (64, 7168, 8192), (256, 7168, 8192)]  # (M, K_local, N)
_ROUNDS, _CALLS, _BLOCK, _WARMUP = 6, 10, 100, 10


def _rank(rank: int, world: int) -> tuple[list[tuple], str]:
    import itertools

    import torch.distributed as dist

    import overlap_kernels as ok

    rows, profile = [], ""
    for m, k, n in SHAPES:
        sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()) for _ in range(2)]  # fmt: skip
        cycle = itertools.cycle(sets)

        def pair(cycle=cycle):
            x, w = next(cycle)
            out = torch.matmul(x, w)
            dist.all_reduce(out)
            return out

        def one_shot(cycle=cycle):
            return ok.gemm_ar(*next(cycle), config={"path": "one_shot"})

        def auto(cycle=cycle):
            return ok.gemm_ar(*next(cycle))

        variants = {"pair": pair, "one_shot": one_shot, "auto": auto}
        for fn in variants.values():
            for _ in range(_WARMUP):
                fn()
        calls = {name: [] for name in variants}
        hosts = {name: [] for name in variants}
        periods = {name: [] for name in variants}
        clock = CudaClock()
        for r in range(_ROUNDS):
            for name in list(variants)[:: 1 if r % 2 else -1]:
                dist.barrier()
                torch.cuda.synchronize()
                calls[name] += clock.elapsed_ms(call_marks(variants[name], _CALLS, clock))
                dist.barrier()
                host, period = enqueue_ms(variants[name], _BLOCK)
                hosts[name].append(host)
                periods[name].append(period)
        for name in variants:
            med = statistics.median
            rows.append(
                (f"{m}x{k}x{n}", name, rank, med(calls[name]), med(hosts[name]), med(periods[name]))
            )
        if m == SHAPES[0][0]:
            dist.barrier()
            text = profile_text(
                one_shot, top=22
            )  # every rank calls (the op waits for its peers); rank 0 reports
            profile = text if rank == 0 else ""
    return rows, profile


def main() -> None:
    from overlap_kernels.launch import run_ranks

    results = run_ranks(_rank, torch.cuda.device_count(), use_gpu=True, timeout_s=400)
    print(
        f"{'shape':<14} {'variant':<9} {'rank':>4} {'call median':>12} {'host/call':>10} {'period':>8}   ms"
    )
    rows = sorted(
        (row for rank_rows, _ in results for row in rank_rows), key=lambda r: (r[0], r[1], r[2])
    )
    for row in rows:
        print(f"{row[0]:<14} {row[1]:<9} {row[2]:>4} {row[3]:12.3f} {row[4]:10.3f} {row[5]:8.3f}")
    print("".join(profile for _, profile in results))


if __name__ == "__main__":
    main()
