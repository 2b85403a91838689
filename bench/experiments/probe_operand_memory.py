"""Does cuBLAS read its A operand slower from the symmetric workspace than from
ordinary device memory? ag_gemm's cuBLAS consumer reads the gathered rows from
the workspace; PyTorch's fused op reads them from an ordinary tensor.

``python -m bench.experiments.probe_operand_memory`` (all GPUs, every rank at once, as in
the benchmark). Per shape: median ms of torch.matmul back to back with A in
ordinary memory and with A in the workspace's data region (max over ranks).
A diagnostic; the numbers to quote come from ``python -m bench``.
"""

from __future__ import annotations

import statistics

import torch

from bench.harness import CudaClock, call_marks

# (rows of A, K, N): ag_gemm's chunk and whole problem at 8192x8192x7168 on 4 ranks.
SHAPES = [(2048, 8192, 7168), (8192, 8192, 7168)]
_CALLS, _WARMUP = 40, 5


def _median_ms(fn) -> float:
    for _ in range(_WARMUP):
        fn()
    clock = CudaClock()
    return statistics.median(clock.elapsed_ms(call_marks(fn, _CALLS, clock)))


def _rank(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from overlap_kernels.runtime.workspace import get_workspace

    ws = get_workspace(None, torch.device("cuda", torch.cuda.current_device()))
    lines = []
    for m, k, n in SHAPES:
        ws.begin("probe", m * k * 2, 30.0)
        in_workspace = ws.data(ws.rank, 0, (m, k), torch.bfloat16)
        ordinary = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        in_workspace.copy_(ordinary)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        times = []
        for a in (ordinary, in_workspace, ordinary, in_workspace):  # twice each, interleaved
            dist.barrier()
            times.append(_median_ms(lambda a=a, w=w, out=out: torch.matmul(a, w, out=out)))
        worst = torch.tensor(times, device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        t = worst.tolist()
        lines.append(
            f"{m}x{k}x{n}: A ordinary {t[0]:.3f} / {t[2]:.3f} ms, A in workspace {t[1]:.3f} / {t[3]:.3f} ms"
        )
    return lines


def main() -> None:
    from overlap_kernels.launch import run_ranks

    print("\n".join(run_ranks(_rank, torch.cuda.device_count(), use_gpu=True, timeout_s=300)[0]))


if __name__ == "__main__":
    main()
