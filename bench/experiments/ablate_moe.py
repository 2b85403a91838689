"""MoE ablation on GPUs: where the time of our MoE ops goes.

``python -m bench.experiments.ablate_moe`` on 2+ GPUs prints, for the DeepSeek-V3-like prefill
shape (4096 tokens per rank, hidden 7168, 256 experts, top-8, intermediate 2048):

- the grouped GEMM alone (one GPU, the gate/up and down products of the rows one
  rank receives): torch._grouped_mm against our Triton kernel with pointer or TMA
  loads and a few tile shapes, in ms and TFLOP/s (CUDA-event medians of 10);
- moe_dispatch split into its steps (host wall time per call with a synchronize
  after each step, mean of 10 calls after 3 warm-up calls): local routing, count
  exchange, send + receive, handle and row expansion; and the whole call.
"""

from __future__ import annotations

import time

import torch

from overlap_kernels.launch import run_ranks

T, H, E, K_TOP, F = 4096, 7168, 256, 8, 2048


def _events_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _gemm_rows(rank: int, world: int) -> list[str]:
    from overlap_kernels.kernels.grouped_gemm import launch_grouped_gemm
    from overlap_kernels.ops.moe import MoeConfig
    from overlap_kernels.ops.moe_details.layout import grouped_tiles

    e_local = E // world
    rows = T * K_TOP  # pairs one rank receives on average
    counts = [rows // e_local] * e_local
    lines = []
    for k, n, what in ((H, 2 * F, "gate/up"), (F, H, "down")):
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(e_local, k, n, device="cuda", dtype=torch.bfloat16) / 30
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * rows * k * n
        ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        ms = _events_ms(lambda a=a, b=b, ends=ends: torch._grouped_mm(a, b, offs=ends))
        lines.append(
            f"{what:8} torch._grouped_mm                {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s"
        )
        for tma, bm, bn, bk, warps, stages in ((False, 128, 128, 64, 8, 3), (True, 128, 128, 64, 8, 3),
                                               (True, 128, 256, 64, 8, 3), (True, 128, 128, 64, 4, 4),
                                               (True, 64, 128, 64, 4, 4)):  # fmt: skip
            cfg = MoeConfig(
                block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=tma
            )
            table = torch.from_numpy(grouped_tiles(counts, bm, bn, n)).cuda()
            ms = _events_ms(
                lambda a=a, b=b, t=table, c=cfg, o=out: launch_grouped_gemm(a, b, t, c, 132, out=o)
            )
            label = f"ours {'tma' if tma else 'ptr'} {bm}x{bn}x{bk} w{warps} s{stages}"
            lines.append(f"{what:8} {label:32} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s")
    return lines


def _dispatch_steps(rank: int, world: int) -> list[str]:
    import overlap_kernels as ok
    from overlap_kernels.ops import moe
    from overlap_kernels.ops.moe_details import layout, steps

    torch.manual_seed(rank)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.rand(T, E, device="cuda").topk(K_TOP, dim=1).indices
    topk_weights = torch.rand(T, K_TOP, device="cuda")
    cfg = moe.MoeConfig().validate()
    group = torch.distributed.group.WORLD
    spent: dict[str, float] = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - begin
        return result

    for call in range(13):
        if call == 3:
            spent.clear()
        timed(
            "local routing",
            lambda: layout.local_routing(topk_ids, topk_weights, world, E, H, x.element_size()),
        )
        rt = timed(
            "route (routing + count exchange)",
            lambda: steps.route("moe_dispatch", x, topk_ids, topk_weights, group, E, cfg, 0, {}),
        )
        recv_tokens, recv_records = timed(
            "send + receive", lambda rt=rt: steps.receive("moe_dispatch", rt, x, cfg)
        )
        handle = timed(
            "handle", lambda rt=rt, records=recv_records: moe._handle(rt, records, T, cfg)
        )
        timed("row expansion", lambda tokens=recv_tokens, rows=handle._token_rows: tokens[rows])
        timed(
            "moe_dispatch (whole)",
            lambda: ok.moe_dispatch(x, topk_ids, topk_weights, group, num_experts=E),
        )
        timed(
            "moe_combine (whole)",
            lambda y=recv_tokens[handle._token_rows], h=handle: ok.moe_combine(y, h),
        )
    return [f"rank {rank} {name:34} {1e3 * s / 10:7.3f} ms" for name, s in spent.items()]


def _body(rank: int, world: int, gemm: bool) -> list[str]:
    lines = _dispatch_steps(rank, world)
    if rank == 0 and gemm:
        lines += _gemm_rows(rank, world)
    return lines


def main() -> None:
    """``python -m bench.experiments.ablate_moe [dispatch]``: ``dispatch`` skips the GEMM sweep."""
    import sys

    world = min(torch.cuda.device_count(), 4)
    for lines in run_ranks(
        _body, world, "dispatch" not in sys.argv[1:], use_gpu=True, timeout_s=400
    ):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
