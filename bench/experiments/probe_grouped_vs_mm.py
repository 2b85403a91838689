"""Is one cuBLAS GEMM per expert faster than ``torch._grouped_mm`` where a rank holds few experts?

At Mixtral-8x22B's prefill (two experts per rank at EP 4, about 4096 rows each) the MoE layer
is bounded by its grouped GEMM (docs/performance.md, MoE). This probe times, on one GPU, a
rank's two expert GEMMs of each preset model at EP 2 and 4 (gate/up [rows, H] @ [H, 2F], down
[rows, F] @ [F, H], rows by expert from a uniform top-k routing of every rank's tokens):
``torch._grouped_mm`` against the library's ``torch.mm`` per expert (moe_details/steps.py).

``python -m bench.experiments.probe_grouped_vs_mm [--reps R]`` (one GPU, bf16).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.moe import PRESETS
from overlap_kernels.ops.moe_details.steps import gemm_per_expert

EPS = (2, 4)


def rows_by_expert(tokens: int, experts: int, k: int, ep: int, seed: int) -> list[int]:
    """Rows that each of rank 0's experts receives: every rank's tokens routed top-k uniformly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens * ep, experts, generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return counts[: experts // ep].tolist()


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls, each between two events, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def compare(rows: int, k: int, n: int, counts: list[int], reps: int) -> tuple[float, float]:
    """(torch._grouped_mm's ms, one torch.mm per expert's ms) for [rows, k] @ [E, k, n] (the
    layer's weight layout), the results checked alike, over interleaved rounds."""
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(len(counts), k, n, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = gemm_per_expert(a, b, counts)
    assert torch.allclose(
        torch._grouped_mm(a, b, offs=ends).float(), out.float(), rtol=2e-2, atol=0.5
    )
    g_ms, m_ms = [], []
    for _ in range(5):  # (interleaved: clocks and neighbours weigh on both alike)
        g_ms.append(timed(lambda: torch._grouped_mm(a, b, offs=ends), reps))
        m_ms.append(timed(lambda: gemm_per_expert(a, b, counts), reps))
    return statistics.median(g_ms), statistics.median(m_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
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
                g, m = compare(rows, kk, n, counts, args.reps)
                print(
                    f"{name:22s} {ep:2d} {len(counts):7d} {rows:6d} {gemm:8s} {g:10.3f} {m:9.3f} {g / m:6.3f}"
                )
    print("ratio: grouped_mm ms over mm-per-expert ms (> 1: one cuBLAS GEMM per expert is faster)")


if __name__ == "__main__":
    main()
