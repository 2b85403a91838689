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
    return profile_text(call, calls=200, top=32)


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
