"""Which part of the benchmark's context slows ag_gemm's fused path at the small shapes?

At 4096x8192x2560 on some H200 x4 hosts our GEMM's fused path timed 0.33-0.36
ms at the first call and in place, and 0.44-0.46 in the benchmark, where the
plain pair did not move (docs/performance.md, "Hosts of one kind differ"). The
benchmark differs from the calls in place in two ways: a barrier before each block of 10 calls, and
inputs cycled over enough sets that none is in L2. This probe times our
fused path (config ``gemm = "triton"``) and the plain pair in each context:

    bench    barrier before each block, inputs cycled (as ``python -m bench``)
    same     barrier before each block, one input set
    nobar    no barrier, inputs cycled

per rank: the median of single calls timed back to back (events), blocks of
10 interleaved over 6 rounds. A diagnostic; the numbers to quote come from
``python -m bench``.

``python -m bench.experiments.probe_context`` (all GPUs).
"""

from __future__ import annotations

import itertools
import statistics

import torch

from bench.harness import CudaClock, call_marks

SHAPES = [(4096, 8192, 2560), (2048, 8192, 7168)]  # (gathered M, K, N)
CONTEXTS = ("bench", "same", "nobar")
_ROUNDS, _CALLS, _WARMUP, _SETS = 6, 10, 5, 6


def _rank(rank: int, world: int) -> list[tuple]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.runtime.collectives import all_gather_single

    rows = []
    clock = CudaClock()
    for m, k, n in SHAPES:
        sets = [(torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()) for _ in range(_SETS)]  # fmt: skip
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)

        def ours(x, w):
            return ok.ag_gemm(x, w, config={"path": "fused", "gemm": "triton"})

        def pair(x, w, gathered=gathered):
            all_gather_single(gathered, x)
            return torch.matmul(gathered, w)

        calls = {}
        for name, fn in (("ours_triton", ours), ("sequential", pair)):
            cycle = itertools.cycle(sets)
            calls[(name, "bench")] = calls[(name, "nobar")] = lambda fn=fn, cycle=cycle: fn(
                *next(cycle)
            )
            calls[(name, "same")] = lambda fn=fn, first=sets[0]: fn(*first)
        for fn in calls.values():
            for _ in range(_WARMUP):
                fn()
        times = {key: [] for key in calls}
        for r in range(_ROUNDS):
            for key in list(calls)[:: 1 if r % 2 else -1]:
                if key[1] != "nobar":
                    dist.barrier()
                    torch.cuda.synchronize()
                times[key] += clock.elapsed_ms(call_marks(calls[key], _CALLS, clock))
        for (name, context), ms in times.items():
            rows.append((f"{m}x{k}x{n}", name, context, rank, statistics.median(ms)))
    return rows


def main() -> None:
    from overlap_kernels.launch import run_ranks

    results = run_ranks(_rank, torch.cuda.device_count(), use_gpu=True, timeout_s=400)
    print(f"{'shape':<16} {'variant':<12} {'context':<7} " + " ".join(f"rank{r:<3}" for r in range(len(results)))
          + "   ms, median of single calls")  # fmt: skip
    by_key: dict[tuple, list[float]] = {}
    for rank_rows in results:
        for shape, name, context, _, ms in rank_rows:
            by_key.setdefault((shape, name, context), []).append(ms)
    for (shape, name, context), per_rank in sorted(by_key.items()):
        print(f"{shape:<16} {name:<12} {context:<7} " + " ".join(f"{ms:7.3f}" for ms in per_rank))


if __name__ == "__main__":
    main()
