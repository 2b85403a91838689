"""Is one cuBLAS GEMM per expert faster than ``torch._grouped_mm`` where a rank holds few experts?

At Mixtral-8x22B's prefill (two experts per rank at EP 4, about 4096 rows each) the MoE layer
is bounded by its grouped GEMM (docs/performance.md, MoE). This probe times, on one GPU, a
rank's two expert GEMMs of each preset model at EP 2 and 4 (gate/up [rows, H] @ [H, 2F], down
[rows, F] @ [F, H], rows by expert from a uniform top-k routing of every rank's tokens):
``torch._grouped_mm`` against the library's ``torch.mm`` per expert (moe_details/steps.py).

``python -m bench.experiments.probe_grouped_vs_mm [--calls N]`` (one GPU, bf16).
"""

from __future__ import annotations

import argparse

import torch

from bench.moe import PRESETS
from overlap_kernels.ops.moe_details.steps import gemm_per_expert
from overlap_kernels.timing import CudaClock, medians, time_calls

EPS = (2, 4)
ROUNDS = 6  # interleaved, in rotated and reversed orders (timing.round_orders)


def rows_by_expert(tokens: int, experts: int, k: int, ep: int, seed: int) -> list[int]:
    """Rows that each of rank 0's experts receives: every rank's tokens routed top-k uniformly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens * ep, experts, generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return counts[: experts // ep].tolist()


def compare(
    rows: int, k: int, n: int, counts: list[int], calls_per_round: int
) -> tuple[float, float]:
    """(torch._grouped_mm's ms, one torch.mm per expert's ms) for [rows, k] @ [E, k, n] (the
    layer's weight layout), the results checked alike (which warms both up), timed as the
    benchmark times variants (overlap_kernels/timing.py)."""
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(len(counts), k, n, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = gemm_per_expert(a, b, counts)
    assert torch.allclose(
        torch._grouped_mm(a, b, offs=ends).float(), out.float(), rtol=2e-2, atol=0.5
    )
    calls = {
        "grouped_mm": lambda: torch._grouped_mm(a, b, offs=ends),
        "per_expert": lambda: gemm_per_expert(a, b, counts),
    }
    ms = medians(time_calls(calls, ROUNDS, calls_per_round, CudaClock()))
    return ms["grouped_mm"], ms["per_expert"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="calls per variant per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'model':22s} {'EP':>2s} {'experts':>7s} {'rows':>6s} {'gemm':8s} "
          f"{'grouped_mm':>10s} {'mm/expert':>9s} {'ratio':>6s}")  # fmt: skip
    for name, (t, h, e, k, f) in PRESETS.items():
        if not name.endswith("prefill") or name == "qwen3_prefill":
            continue
        for ep in EPS:
            counts = rows_by_expert(t, e, k, ep, seed=ep)
            rows = sum(counts)
            for gemm, (kk, n) in (("gate_up", (h, 2 * f)), ("down", (f, h))):
                g, m = compare(rows, kk, n, counts, args.calls)
                print(
                    f"{name:22s} {ep:2d} {len(counts):7d} {rows:6d} {gemm:8s} {g:10.3f} {m:9.3f} {g / m:6.3f}"
                )
    print("ratio: grouped_mm ms over mm-per-expert ms (> 1: one cuBLAS GEMM per expert is faster)")


if __name__ == "__main__":
    main()
