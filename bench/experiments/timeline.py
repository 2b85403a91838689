"""Where the device time of one call goes: a kernel and copy timeline per variant.

``python -m bench.experiments.timeline [--m M] [--only PREFIX,...]`` (all GPUs). For ag_gemm,
gemm_rs and gemm_ar's two_shot at a large shape (M total rows, 8192 unless
``--m``) and gemm_ar at two decode sizes, each variant (those whose name starts
with one of ``--only``'s prefixes) is warmed up,
then three calls back to back are recorded by torch.profiler on every rank;
rank 0 prints, for the middle call, every kernel and copy with its stream,
start (us from the call's first device event) and duration. Gaps between a
call's kernels on one stream are host time (launches) or waits.
A diagnostic for finding overheads; the numbers to quote come from ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

AG_KN, RS_KN, AR_DECODE = (8192, 7168), (7168, 8192), ((16, 7168, 8192), (256, 7168, 8192))


def _variants(world: int, group_name: str, m: int) -> dict:
    import overlap_kernels as ok

    (ag_k, ag_n), (rs_k, rs_n) = AG_KN, RS_KN
    ag_m = rs_m = m
    x_ag = torch.randn(ag_m // world, ag_k, device="cuda", dtype=torch.bfloat16)
    w_ag = torch.randn(ag_n, ag_k, device="cuda", dtype=torch.bfloat16).t()
    x_ag_full = torch.cat([x_ag] * world)
    x_rs = torch.randn(rs_m, rs_k, device="cuda", dtype=torch.bfloat16)
    w_rs = torch.randn(rs_n, rs_k, device="cuda", dtype=torch.bfloat16).t()
    symm = torch.ops.symm_mem
    pulled = {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1}
    variants = {
        "ag_cublas_alone": lambda: torch.matmul(x_ag_full, w_ag),
        "ag_torch_fused": lambda: symm.fused_all_gather_matmul(
            x_ag, [w_ag], 0, group_name, return_A=False
        ),
        "ag_ours_cublas": lambda: ok.ag_gemm(
            x_ag, w_ag, config={"path": "fused", "gemm": "cublas"}
        ),
        "ag_ours_triton": lambda: ok.ag_gemm(
            x_ag, w_ag, config={"path": "fused", "gemm": "triton"}
        ),
        "rs_torch_fused": lambda: symm.fused_matmul_reduce_scatter(
            x_rs, w_rs, "sum", 0, group_name
        ),
        "rs_ours_ce_cublas": lambda: ok.gemm_rs(
            x_rs, w_rs, config={**pulled, "producer": "cublas"}
        ),
        "rs_ours_ce_triton": lambda: ok.gemm_rs(
            x_rs, w_rs, config={**pulled, "producer": "triton"}
        ),
        "ar_sequential": lambda: ok.gemm_ar(x_rs, w_rs, config={"path": "sequential"}),
        "ar_ours_push": lambda: ok.gemm_ar(
            x_rs, w_rs, config={"path": "two_shot", "mechanism": "push"}
        ),
        "ar_ours_ce": lambda: ok.gemm_ar(
            x_rs, w_rs, config={**pulled, "path": "two_shot", "lag": None}
        ),
    }
    for decode_m, k, n in AR_DECODE:
        x = torch.randn(decode_m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        variants[f"ar{decode_m}_sequential"] = lambda x=x, w=w: ok.gemm_ar(
            x, w, config={"path": "sequential"}
        )
        variants[f"ar{decode_m}_one_shot"] = lambda x=x, w=w: ok.gemm_ar(
            x, w, config={"path": "one_shot"}
        )
    return variants


def _device_events(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")  # device work (not runtime calls)
    return sorted(
        (e for e in events if e.get("cat") in kinds and "dur" in e), key=lambda e: e["ts"]
    )


def _middle_call(events: list[dict], calls: int) -> list[dict]:
    """The events of the middle call: the trace's device events cut into ``calls``
    runs at the marker kernel enqueued before each call."""
    marks = [i for i, e in enumerate(events) if "spin_kernel" in e["name"]]
    if len(marks) < calls:
        return events
    middle = calls // 2
    return (
        events[marks[middle] + 1 : marks[middle + 1]]
        if middle + 1 < len(marks)
        else events[marks[middle] + 1 :]
    )


def _describe(name: str, events: list[dict]) -> list[str]:
    if not events:
        return [f"{name}: no device events"]
    t0 = events[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in events)
    lines = [f"{name}: {end - t0:.1f} us from first to last device event"]
    for e in events:
        stream = e.get("args", {}).get("stream", "?")
        lines.append(f"  s{stream:<4} +{e['ts'] - t0:8.1f} {e['dur']:8.1f} us  {e['name'][:90]}")
    return lines


def _rank(rank: int, world: int, m: int, only: tuple[str, ...]) -> list[str]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from bench.common import enable_symm_mem

    group_name = dist.group.WORLD.group_name
    enable_symm_mem(group_name)
    calls = 3
    for name, call in _variants(world, group_name, m).items():
        if not name.startswith(only):
            continue
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                torch.cuda._sleep(1)  # a marker kernel (spin_kernel): where each call starts
                call()
            torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            path = os.path.join(tempfile.gettempdir(), f"timeline_{name}.json")
            prof.export_chrome_trace(path)
            print("\n".join(_describe(name, _middle_call(_device_events(path), calls))), flush=True)


def main() -> None:
    from overlap_kernels.launch import run_ranks

    parser = argparse.ArgumentParser(
        prog="python -m bench.experiments.timeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--m", type=int, default=8192, help="total rows of the large shapes (default 8192)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated name prefixes (ag_, rs_, ar_, ar16_, ...)"
    )
    args = parser.parse_args()
    only = tuple(p for p in args.only.split(",") if p) or ("",)
    run_ranks(_rank, torch.cuda.device_count(), args.m, only, use_gpu=True, timeout_s=400)


if __name__ == "__main__":
    main()
