"""Probe: what a repeated call pays to find its plan (ops/plans.py) and to be
refused grad (ops/checks.refuse_grad): the per-call host cost of the checks
that keep ranks agreeing, which exchange nothing once a plan exists.

    python -m bench.experiments.probe_plan_lookup
"""

from __future__ import annotations

import timeit

import torch


def main() -> None:
    import torch.distributed as dist

    from overlap_kernels.ops import plans
    from overlap_kernels.ops.checks import refuse_grad

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    x = torch.randn(16, 7168, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 7168, device=device, dtype=torch.bfloat16).t()
    key = plans.signature("gemm_ar", x, w, None, None)
    plans._cache(key[1])[key] = object()  # a cached plan: the lookup below finds it
    calls = {
        "refuse_grad": lambda: refuse_grad("gemm_ar", x, w),
        "signature": lambda: plans.signature("gemm_ar", x, w, None, None),
        "signature + lookup": lambda: plans.plan_for("gemm_ar", plans.signature("gemm_ar", x, w, None, None), None),
    }  # fmt: skip
    for name, call in calls.items():
        runs = [timeit.timeit(call, number=20000) / 20000 * 1e6 for _ in range(7)]
        print(f"{name:>20}: {sorted(runs)[3]:.2f} us per call (median of 7 x 20000, {device})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
