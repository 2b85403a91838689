"""Probe: a new process's first fused call, with Triton's cache from an earlier process.

    python -m bench.experiments.probe_compile_cache [--processes 2] [--world 2]

Each round starts ``world`` ranks sharing the GPUs (run_ranks, gloo between
them) and times every rank's first call and its tenth of a fused ag_gemm,
gemm_rs and gemm_ar (kernels that wait for peers), all rounds on one
TRITON_CACHE_DIR that starts empty. Where every kernel's cache key is the same
in every process, only the first round compiles; rounds after it load the
kernels from the cache and their first calls take a fraction of its time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

OPS = (
    ("ag_gemm", {"path": "fused"}),
    ("gemm_rs", {"path": "fused"}),
    ("gemm_ar", {"path": "one_shot"}),
)


def body(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """Seconds of each op's first call and of a later one, on this rank."""
    import overlap_kernels as ok

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(256, 1024, dtype=torch.bfloat16, device=device)
    w = torch.randn(1024, 512, dtype=torch.bfloat16, device=device)
    times = {}
    for name, config in OPS:
        call = getattr(ok, name)
        start = time.perf_counter()
        call(x, w, config=config)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        for _ in range(9):
            call(x, w, config=config)
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(x, w, config=config)
        torch.cuda.synchronize()
        times[name] = (first, time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="rounds of new rank processes")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    from overlap_kernels.launch import run_ranks

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    print(f"TRITON_CACHE_DIR={os.environ['TRITON_CACHE_DIR']} (empty at round 1)")
    for round_ in range(1, args.processes + 1):
        per_rank = run_ranks(body, args.world, use_gpu=True, timeout_s=900)
        for name, _ in OPS:
            first = max(times[name][0] for times in per_rank)
            later = max(times[name][1] for times in per_rank)
            print(f"round {round_}  {name:<8} first call {first:8.3f} s   tenth call {later * 1e3:8.3f} ms"
                  "  (max over ranks)")  # fmt: skip


if __name__ == "__main__":
    main()
