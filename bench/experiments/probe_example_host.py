"""Probe: are the worked examples' short calls bound by the host? And where does a plain
gemm_ar call's host time go?

    python -m bench.experiments.probe_example_host [--m 512] [--calls 50]

One rank per GPU (all of them). Per example of ``python -m bench --op examples`` at
M x 4096 x 3584, the fused op and its split pair: host ms to enqueue one call behind
a GPU sleep (nothing waits for the device) and device ms per call over the same calls,
max over ranks. A call whose host time exceeds its device time is host-bound, and its
benchmark time is the host's. Then gemm_ar's plain path at 256 x (3584 per rank) x
8192 beside its pair (torch.matmul, NCCL's all-reduce), timed alike. Rank 0 prints
torch.profiler's CPU table and cProfile's of the fused swiglu call, and cProfile's of the
plain gemm_ar call. A diagnostic; the numbers to quote come from ``python -m bench``.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 400_000_000  # ~0.2 s at H200 clocks: longer than enqueueing the calls


def _api_table(call, calls: int = 20) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)


def _body(rank: int, world: int, m: int, calls: int) -> tuple[list, str]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from bench import examples
    from bench.common import enqueue_ms, load_ours, profile_text
    from bench.harness import RunContext, WallClock

    device = torch.device("cuda", torch.cuda.current_device())
    ctx = RunContext(rank, world, device, None, WallClock(), dist.barrier, None)
    ours, _ = load_ours("ag_gemm", ("ag_gemm", "gemm_rs"))
    sets = [examples._make_inputs(m, 4096, 3584, ctx, seed) for seed in (0, 1)]
    variants, _ = examples._variants(ctx, sets, ours)
    calls_of = {v.name: v.fn for v in variants}

    x = torch.randn(256, 3584, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 3584, device=device, dtype=torch.bfloat16).t()

    def pair():
        out = torch.matmul(x, w)
        dist.all_reduce(out)
        return out

    calls_of["gemm_ar_plain"] = lambda: ok.gemm_ar(x, w, config={"path": "sequential"})
    calls_of["gemm_ar_pair"] = pair
    rows = []
    for name, call in calls_of.items():
        for _ in range(5):  # compiled, loaded, planned and agreed
            call()
        torch.cuda.synchronize()
        dist.barrier()
        host, dev = enqueue_ms(call, calls, SLEEP_CYCLES)
        rows.append((name, host, dev))
        dist.barrier()
    report = ""
    fused = calls_of["swiglu_fused"]
    table = _api_table(fused)  # every rank calls: the op is collective
    own = profile_text(fused, calls=200, top=30)
    total = profile_text(fused, calls=200, top=40, sort="cumulative")
    plain = profile_text(calls_of["gemm_ar_plain"], calls=200, top=25)
    if rank == 0:
        parts = ("swiglu_fused, torch.profiler (CPU, 20 calls)", table, "swiglu_fused, cProfile",
                 own, total, "gemm_ar plain, cProfile", plain)  # fmt: skip
        report = "\n".join(parts)
    dist.barrier()
    return rows, report


def main() -> None:
    from overlap_kernels.launch import gpu_count, run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=512, help="gathered rows of the examples")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    results = run_ranks(_body, gpu_count(), args.m, args.calls, use_gpu=True, timeout_s=400)
    print(f"{'call':<16} {'host':>8} {'device':>8}   ms per call, max over {len(results)} ranks")
    per_rank = [{name: (host, dev) for name, host, dev in rows} for rows, _ in results]
    for name in per_rank[0]:
        host = max(r[name][0] for r in per_rank)
        dev = max(r[name][1] for r in per_rank)
        print(f"{name:<16} {host:8.3f} {dev:8.3f}{'  host-bound' if host > dev else ''}")
    print("".join(report for _, report in results))


if __name__ == "__main__":
    main()
