"""Probe: where a repeated call's host time goes (cProfile, top functions by
own time), for matmul on one GPU and the fused ops on 2 ranks sharing it.

    python -m bench.experiments.probe_host_profile
"""

from __future__ import annotations

import torch

M, K, N = 16, 7168, 8192


def _profile(call) -> str:
    from bench.common import profile_text

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    own = profile_text(call, calls=200, top=32)
    return own + profile_text(call, calls=200, top=45, sort="cumulative") + _api_calls(call)


def _api_calls(call, calls: int = 50) -> str:
    """torch.profiler's CPU-side table: aten ops and CUDA runtime/driver calls per call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return f"(torch.profiler, {calls} calls)\n" + prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=30
    )


def fused_rank(rank: int, world: int, use_gpu: bool) -> str:
    import overlap_kernels as ok

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(M, K // world, dtype=torch.bfloat16, device=device)
    w = torch.randn(N, K // world, dtype=torch.bfloat16, device=device).t()
    xa = torch.randn(M // world, K, dtype=torch.bfloat16, device=device)
    wa = torch.randn(N, K, dtype=torch.bfloat16, device=device).t()
    texts = []
    for name, call in (
        ("gemm_ar", lambda: ok.gemm_ar(x, w)),
        ("gemm_ar two_shot", lambda: ok.gemm_ar(x, w, config={"path": "two_shot"})),
        ("gemm_rs", lambda: ok.gemm_rs(x, w, config={"path": "fused"})),
        ("ag_gemm", lambda: ok.ag_gemm(xa, wa, config={"path": "fused"})),
    ):
        texts.append(f"--- {name} (rank {rank})\n{_profile(call)}")
    return "\n".join(texts) if rank == 0 else ""


def main() -> None:
    import overlap_kernels as ok
    from overlap_kernels.launch import run_ranks

    a = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(N, K, dtype=torch.bfloat16, device="cuda").t()
    print("--- matmul\n" + _profile(lambda: ok.matmul(a, b)))
    print(run_ranks(fused_rank, 2, True, use_gpu=True, gpus=1)[0])


if __name__ == "__main__":
    main()
