"""The CPU demo: every op on emulated ranks, checked against an fp64 reference.

``python -m overlap_kernels.demo`` (or ``python -m bench`` on a machine with no
GPU) starts 4 rank processes that talk through gloo and shared-memory files,
runs ag_gemm in Triton's interpreter with each schedule factory and
mechanism, and prints one line per case: schedule, dtype, the relative error against
float64, the error the plain product makes in the same dtype, and whether it
passed the tests' checks (overlap_kernels/reference.py: at most twice the
plain product's error overall, and a bound on every element).
"""

from __future__ import annotations

import sys
import time

import torch

from .launch import run_ranks

WORLD = 4


def _cases():
    from . import schedules as s

    return [
        ("ring", s.ring, s.COPY_ENGINE, 1),
        ("direct", s.direct, s.COPY_ENGINE, 1),
        ("bidirectional", s.bidirectional, s.COPY_ENGINE, 2),
        ("ring", s.ring, s.SM_COPY, 2),
        ("direct", s.direct, s.SM_COPY, 3),
    ]


def _rank_main(rank: int, world: int) -> list[tuple]:
    import torch.distributed as dist

    from . import ag_gemm, schedules
    from .reference import judge_matmul

    torch.manual_seed(1000 + rank)
    rows = []
    for name, factory, mechanism, pieces in _cases():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(21, 96, dtype=dtype)  # 21 rows per rank: ragged for every tile size
            w = torch.randn(80, 96, dtype=dtype).t()  # nn.Linear layout
            schedule = schedules.split(schedules.with_mechanism(factory(world), mechanism), pieces)
            begin = time.perf_counter()
            out = ag_gemm(x, w, schedule=schedule, config={"path": "fused", "comm_sms": 2})
            seconds = time.perf_counter() - begin
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            verdict = judge_matmul(out, torch.cat(parts), w)
            passed = verdict.problem is None
            label = f"{name}/{mechanism}/x{pieces}"
            rows.append((label, str(dtype).removeprefix("torch."), verdict.error, verdict.plain_error, passed, seconds))
    return rows


def main(world: int = WORLD) -> int:
    print(f"overlap_kernels CPU demo: ag_gemm on {world} emulated ranks (Triton interpreter, gloo, shared memory)")
    print("x [21, 96] per rank, w [96, 80]; reference: float64 all_gather(x) @ w\n")
    results = run_ranks(_rank_main, world)
    header = f"{'schedule/mechanism/pieces':<32}{'dtype':<10}{'rel. error':>12}{'plain err':>12}{'ok':>5}{'s':>7}"
    print(header)
    print("-" * len(header))
    all_ok = True
    for case in range(len(results[0])):
        # Worst rank for each case.
        name, dtype, err, plain_err, _, seconds = max((r[case] for r in results), key=lambda row: row[2])
        ok = all(r[case][4] for r in results)
        all_ok &= ok
        print(f"{name:<32}{dtype:<10}{err:>12.2e}{plain_err:>12.2e}{'yes' if ok else 'NO':>5}{seconds:>7.2f}")
    print("\nall cases correct" if all_ok else "\nSOME CASES FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
