"""Probe: the host time of the GEMM ops where they run no kernel of ours, on CPU.

    python -m bench.experiments.probe_plain_host [--calls N] [--rounds R]

1. One rank (a gloo group of one process): ag_gemm, gemm_rs and gemm_ar are
   ``x @ w`` (ops/paths.LocalGemm), each timed against torch.matmul on the same
   tiny operands, with and without ``out=``.
2. Two ranks, the plain path (``path="sequential"``): each op against its pair
   (torch.matmul, then the collective), with the collective replaced by the
   same no-op on both sides and the group's backend read as NCCL's, so that
   the difference is the op's own host work (its checks, plan lookup, buffers).

Tiny fp32 operands (16 x 64 x 48): torch's product is about as cheap as a
call can be, so the ratios are the worst a host sees. A CPU's times are only
a proxy for a GPU host's, where torch.matmul enqueues in 12-23 us
(KNOWLEDGE.md) and ``python -m bench.host_time --world 1`` measures the real
thing. Calls are timed in interleaved rounds (each case a batch in turn),
medians over rounds, by the thread's CPU time (time.thread_time): on a shared
host the wall clock also counts the time other processes hold the core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable

import torch

M, K, N = 16, 64, 48
OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


def timed(cases: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """us per call of each case: the median over ``rounds`` batches of ``calls``."""
    for call in cases.values():
        call()
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in list(cases)[:: -1 if r % 2 else 1]:
            timer = timeit.Timer(cases[name], timer=time.thread_time)
            runs[name].append(timer.timeit(number=calls) / calls * 1e6)
    return {name: statistics.median(us) for name, us in runs.items()}


def operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype).t()  # nn.Linear layout


def local_cases(ok, x, w, out) -> dict[str, Callable[[], object]]:
    """torch.matmul and each op on one rank, each with and without ``out``."""
    cases: dict[str, Callable[[], object]] = {
        "torch.matmul": lambda: torch.matmul(x, w),
        "torch.matmul out=": lambda: torch.matmul(x, w, out=out),
    }
    for op in OPS:
        fn = getattr(ok, op)
        cases[op] = lambda fn=fn: fn(x, w)
        cases[f"{op} out="] = lambda fn=fn: fn(x, w, out=out)
    return cases


def one_rank(calls: int, rounds: int) -> list[str]:
    import torch.distributed as dist

    import overlap_kernels as ok

    dist.init_process_group(
        "gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1
    )
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        us = timed(local_cases(ok, *operands(dtype), torch.empty(M, N, dtype=dtype)), calls, rounds)
        for name, t in us.items():
            base = us["torch.matmul out=" if "out=" in name else "torch.matmul"]
            lines.append(f"{str(dtype)[6:]:>8}  {name:<18} {t:6.2f} us  x{t / base:.3f}  "
                         f"({t - base:+.2f} us)")  # fmt: skip
    dist.destroy_process_group()
    return lines


class _Done:
    def wait(self, *args: object) -> bool:
        return True


def _no_op(*args: object, **kwargs: object) -> _Done:
    return _Done()


def two_ranks_body(rank: int, world: int, calls: int, rounds: int) -> list[str]:
    """Each op's plain path against its pair, the collectives made no-ops."""
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.ops import ag_gemm, gemm_rs
    from overlap_kernels.runtime import collectives

    torch.set_flush_denormal(True)  # (as in main: this process is a spawned rank)
    x, w = operands(torch.float32)
    sequential = {"path": "sequential"}
    group = dist.group.WORLD
    # The plain paths' NCCL branches (a backend that also serves CPU tensors: the plans'
    # checks take it), with every collective a no-op; the agreement goes through the store.
    collectives._BACKENDS[id(group)] = (group, "cpu:gloo,cuda:nccl")
    for module, name in ((dist, "all_reduce"), (dist, "all_gather_into_tensor"),
                         (dist, "reduce_scatter_tensor"), (ag_gemm, "all_gather_single"),
                         (gemm_rs, "reduce_scatter_single")):  # fmt: skip
        setattr(module, name, _no_op)
    for op in OPS:  # the plans, made and agreed on
        getattr(ok, op)(x, w, config=sequential)

    # The pairs as a caller writes them, each allocating what it returns.
    def pair_ag() -> torch.Tensor:
        gathered = torch.empty(M * world, K)
        dist.all_gather_into_tensor(gathered, x, group=group)
        return torch.matmul(gathered, w)

    def pair_rs() -> torch.Tensor:
        out = torch.empty(M // world, N)
        dist.reduce_scatter_tensor(out, torch.matmul(x, w), group=group)
        return out

    def pair_ar() -> torch.Tensor:
        out = torch.matmul(x, w)
        dist.all_reduce(out, group=group)
        return out

    cases = {
        "ag_gemm": lambda: ok.ag_gemm(x, w, config=sequential),
        "pair ag": pair_ag,
        "gemm_rs": lambda: ok.gemm_rs(x, w, config=sequential),
        "pair rs": pair_rs,
        "gemm_ar": lambda: ok.gemm_ar(x, w, config=sequential),
        "pair ar": pair_ar,
    }
    us = timed(cases, calls, rounds)
    lines = []
    for op, pair in (("ag_gemm", "pair ag"), ("gemm_rs", "pair rs"), ("gemm_ar", "pair ar")):
        lines.append(f"rank {rank}  {op:<8} {us[op]:6.2f} us, its pair {us[pair]:6.2f} us: "
                     f"{us[op] - us[pair]:+.2f} us of the op's own")  # fmt: skip
    dist.barrier()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--skip-two-ranks", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before overlap_kernels is imported)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # (new buffers' leftover bytes made a product 50x slower)
    print(f"one rank, {M}x{K}x{N}, us per call (median of {args.rounds} x {args.calls}):")
    print("\n".join(one_rank(args.calls, args.rounds)))
    if args.skip_two_ranks:
        return
    from overlap_kernels.launch import run_ranks

    print("two ranks, plain path, collectives made no-ops (the op's own host work):")
    for lines in run_ranks(two_ranks_body, 2, args.calls, args.rounds, timeout_s=600):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
