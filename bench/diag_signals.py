"""Diagnose the signal path on GPUs: timer, waits, stream-written flags, one ag_gemm call.

``python -m bench.diag_signals`` (2+ GPUs). Prints what each rank sees.
"""

from __future__ import annotations

import time

import torch


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.runtime.signals import _spin_probe_kernel, wait_budget
    from overlap_kernels.runtime.workspace import get_workspace

    report = {}
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    for seconds in (0.05, 0.2):
        err.zero_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        _spin_probe_kernel[(1,)](flag, err.data_ptr(), wait_budget(seconds), True)
        torch.cuda.synchronize()
        report[f"unset wait {seconds}s"] = (round(time.perf_counter() - t, 3), err.tolist())
    flag.fill_(1)
    err.zero_()
    torch.cuda.synchronize()
    t = time.perf_counter()
    _spin_probe_kernel[(1,)](flag, err.data_ptr(), wait_budget(1.0), True)
    torch.cuda.synchronize()
    report["set wait"] = (round(time.perf_counter() - t, 4), err.tolist())
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    for mech in ("copy_engine", "sm_copy"):
        try:
            out = ok.ag_gemm(x, w, config={"path": "fused", "timeout_s": 3.0, "mechanism": mech, "comm_sms": 4})
            torch.cuda.synchronize()
            ws = get_workspace(None, x.device)
            report[f"{mech} epoch"] = ws.epoch
            report[f"{mech} ready flags"] = ws.ready_flags[:world].tolist()
            report[f"{mech} chunk flags"] = ws.chunk_flags[: world + 2].tolist()
            report[f"{mech} error record"] = ws.error_record.tolist()
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            ref = torch.cat(parts).float() @ w.float()
            report[f"{mech} rel err"] = ((out.float() - ref).norm() / ref.norm()).item()
            ws.error_record.zero_()
            ws._failure = None
        except Exception as e:  # report and go on to the next mechanism
            report[f"{mech} raised"] = f"{type(e).__name__}: {e}"[:300]
    return report


def main() -> None:
    from overlap_kernels.launch import run_ranks

    for rank, rep in enumerate(run_ranks(_rank, 2, use_gpu=True, timeout_s=240)):
        for k, v in rep.items():
            print(f"rank {rank} {k}: {v}")


if __name__ == "__main__":
    main()
