"""Probe: a repeated fused call's host time, layer by layer, on 2 ranks sharing one GPU.

    python -m bench.experiments.probe_host_layers

Each row times a deeper entry point of the same decode-size call behind a GPU
sleep (bench.common.enqueue_timing): the public op, the kept plan, the
launch-plan run, the bare kernel relaunch; and the single host primitives a
call is made of. The differences between rows are what each layer costs
(cProfile's own overhead hides that at a few microseconds per function).
"""

from __future__ import annotations

import statistics

import torch

M, K, N = 16, 7168, 8192
CALLS, REPS = 50, 7
SLEEP_CYCLES = 100_000_000  # 50 ms at 2 GHz: outlasts 50 calls of 200 us


def _us(call) -> tuple[float, bool]:
    from bench.common import enqueue_timing

    for _ in range(5):
        call()
    runs = [enqueue_timing(call, CALLS, SLEEP_CYCLES) for _ in range(REPS)]
    return statistics.median(r[0] for r in runs) * 1e3, all(r[2] for r in runs)


def _primitives(x: torch.Tensor) -> list[tuple[str, object]]:
    from triton.runtime.driver import driver

    from overlap_kernels.ops.paths import capturing

    device = x.device
    return [
        ("torch.empty [16, 8192] bf16", lambda: torch.empty((M, N), dtype=x.dtype, device=device)),
        (
            "torch.empty_strided",
            lambda: torch.empty_strided((M, N), (N, 1), dtype=x.dtype, device=device),
        ),
        ("x.new_empty", lambda: x.new_empty((M, N))),
        ("paths.capturing(device)", lambda: capturing(device)),
        ("torch._C._cuda_isCurrentStreamCapturing", torch._C._cuda_isCurrentStreamCapturing),
        (
            "driver.active.get_current_stream",
            lambda: driver.active.get_current_stream(device.index),
        ),
        ("torch._C._cuda_getDevice", torch._C._cuda_getDevice),
        ("x.device", lambda: x.device),
        ("torch.is_grad_enabled", torch.is_grad_enabled),
    ]


def _layers(op: str, x, w, config) -> list[tuple[str, object]]:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.ops import plans
    from overlap_kernels.ops.reduce_details.run import run_plan

    call = getattr(ok, op)
    rows = [(f"{op} (public op)", lambda: call(x, w, config=config))]
    call(x, w, config=config)
    plan = next(reversed(plans._cache(dist.group.WORLD).values()))  # the call's, just used
    rows.append((f"{op} plan(x, w, None)", lambda: plan(x, w, None)))
    if op == "ag_gemm":
        return rows + _ag_gemm_layers(plan, x, w)
    fused = getattr(plan, "fused", None)
    if fused is None or not hasattr(fused, "plans"):
        return rows
    out = torch.empty(plan.out_shape, dtype=x.dtype, device=x.device)
    rows.append(
        (f"{op} fused(x, w, out, cfg, word)", lambda: fused(x, w, out, plan.cfg, plan.word))
    )
    ws = fused.ws
    epoch = ws.epoch
    launch_plan = next(iter(fused.plans.values()))
    rows.append((f"{op} run_plan (fixed epoch)",
                 lambda: run_plan(ws, launch_plan, x, w, out, plan.cfg, epoch, fused.budget, 1.0, plan.word)))  # fmt: skip
    again = next(iter(launch_plan.relaunches.values()), None)
    if again is not None:
        # The signature word's share of a call's host time: the launch with and without it changed.
        rows.append((f"{op} relaunch(scratch, 5 args)", lambda: again(ws.launch_scratch, a_ptr=x, b_ptr=w,
                                                                     out_ptr=out, scale=1.0, epoch=epoch)))  # fmt: skip
        rows.append((f"{op} relaunch(scratch, 5 args + word)", lambda: again(ws.launch_scratch, a_ptr=x, b_ptr=w,
                                                                     out_ptr=out, scale=1.0, epoch=epoch, word=plan.word)))  # fmt: skip
        rows.append((f"{op} relaunch()", lambda: again()))
    return rows


def _ag_gemm_layers(plan, x, w) -> list[tuple[str, object]]:
    if not plan.fused:
        return []
    out = torch.empty(plan.out_shape, dtype=x.dtype, device=x.device)
    cfg = plan.cfg
    ws = plan.ws
    epoch = ws.epoch
    transfer = plan._transfer_plan(x, epoch)
    rows = [("ag_gemm _fused(x, w, cfg, out)", lambda: plan._fused(x, w, cfg, out))]
    if transfer.push is not None:
        rows.append(
            ("ag_gemm _gemm (fixed epoch)", lambda: plan._gemm(ws, transfer, x, w, cfg, out, epoch))
        )
        again = next(iter(transfer.relaunches.values()), None)
        if again is not None:
            rows.append(("ag_gemm ChunkedGemmRelaunch(...)",
                         lambda: again(transfer.gathered, w, out, epoch, ws.launch_scratch, x)))  # fmt: skip
            rows.append(("ag_gemm relaunch()", lambda: again.again()))
    return rows


def rank_main(rank: int, world: int, use_gpu: bool) -> list[tuple[str, float, bool]]:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(M, K // world, dtype=torch.bfloat16, device=device)
    w = torch.randn(N, K // world, dtype=torch.bfloat16, device=device).t()
    xa = torch.randn(M // world, K, dtype=torch.bfloat16, device=device)
    wa = torch.randn(N, K, dtype=torch.bfloat16, device=device).t()
    rows = list(_primitives(x))
    rows += _layers("gemm_ar", x, w, None)
    rows += _layers("gemm_rs", x, w, {"path": "fused"})
    rows += _layers("ag_gemm", xa, wa, {"path": "fused"})
    rows += _layers("ag_gemm", xa, wa, {"path": "fused", "mechanism": "push"})
    return [(name, *_us(call)) for name, call in rows]


def main() -> None:
    from overlap_kernels.launch import run_ranks

    results = run_ranks(rank_main, 2, True, use_gpu=True, gpus=1)
    print(f"{'host us per call (max over 2 ranks sharing one GPU)':58s} {'us':>8s}  sleep held")
    for i, (name, _, _) in enumerate(results[0]):
        us = max(r[i][1] for r in results)
        held = all(r[i][2] for r in results)
        print(f"{name:58s} {us:8.2f}  {held}")


if __name__ == "__main__":
    main()
