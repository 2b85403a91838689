"""MoE ablation on GPUs: where the time of our MoE ops goes.

``python -m bench.experiments.ablate_moe`` on 2+ GPUs prints, for the DeepSeek-V3-like prefill
shape (4096 tokens per rank, hidden 7168, 256 experts, top-8, intermediate 2048):

- the grouped GEMM alone (one GPU, the gate/up and down products of the rows one
  rank receives): torch._grouped_mm against our Triton kernel with pointer or TMA
  loads and a few tile shapes, in ms and TFLOP/s (CUDA-event medians of 10);
- moe_dispatch split into its steps (host wall time per call with a synchronize
  after each step, mean of 10 calls after 3 warm-up calls): local routing, count
  exchange, send + receive, handle and row expansion; and the whole call;
- ``fused``: why the fused layer is slower than the unfused one at prefill, one
  lever at a time (CUDA-event medians of 10, max over ranks; docs/design.md, "The
  fused path at prefill"): each half of the layer fused and unfused
  (moe_dispatch_gemm, moe_gemm_combine), then the dispatch GEMM alone on rows that
  have all arrived, changing one thing per line: its waits (flags already set),
  its tile order (by arrival vs by expert, group_m's L2 reuse), its A rows
  (gathered through the records by pointer loads vs the expanded recv_x read by
  TMA), and torch._grouped_mm on the same rows.

``python -m bench.experiments.ablate_moe [gemm] [dispatch] [fused]`` runs the
sections named (all three without one).
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


def _max_over_ranks(ms: float) -> float:
    value = torch.tensor([ms], device="cuda")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _fused_ablation(rank: int, world: int) -> list[str]:
    """The fused path's levers, one at a time (module docstring)."""
    import overlap_kernels as ok
    from overlap_kernels.kernels.grouped_gemm import launch_grouped_gemm
    from overlap_kernels.ops import moe
    from overlap_kernels.ops.moe_details import steps
    from overlap_kernels.ops.moe_details.layout import grouped_tiles
    from overlap_kernels.runtime.platform import FAST_SIGNALS, num_sms
    from overlap_kernels.runtime.signals import wait_budget

    torch.manual_seed(rank)
    e_local, dev = E // world, "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(K_TOP, dim=1).indices
    weights = torch.rand(T, K_TOP, device=dev)
    w1 = torch.randn(e_local, H, 2 * F, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(e_local, F, H, device=dev, dtype=torch.bfloat16) / F**0.5
    group, kw = torch.distributed.group.WORLD, {"num_experts": E}
    rows: list[tuple[str, float]] = []

    def timed(name: str, fn) -> None:
        torch.distributed.barrier()
        rows.append((name, _max_over_ranks(_events_ms(fn))))

    for path in ("unfused", "fused"):
        cfg = {"path": path}
        timed(f"moe_mlp {path}", lambda cfg=cfg: ok.moe_mlp(x, ids, weights, w1, w2, group, **kw, config=cfg))  # fmt: skip
        timed(f"moe_dispatch_gemm {path}", lambda cfg=cfg: ok.moe_dispatch_gemm(x, ids, weights, w1, group, **kw, config=cfg))  # fmt: skip
        h, handle = ok.moe_dispatch_gemm(x, ids, weights, w1, group, **kw, config=cfg)
        act = h[:, :F].contiguous()  # (the activation's width; its values do not matter here)
        timed(f"moe_gemm_combine {path}", lambda a=act, handle=handle, cfg=cfg: ok.moe_gemm_combine(a, w2, handle, config=cfg))  # fmt: skip
    # The dispatch GEMM alone, every source's rows already here (its waits pass at once).
    cfg = moe._config(None, H, E, world, x.dtype)
    rt = steps.route("moe_dispatch", x, ids, weights, group, E, cfg, 0, {})
    recv_tokens, recv_records = steps.receive("moe_dispatch", rt, x, cfg)
    torch.cuda.synchronize()
    ws, n = rt.ws, 2 * F
    epoch = ws.epoch  # the data step's: every source's flag holds it
    out = torch.empty(rt.layout.recv_rows, n, device=dev, dtype=torch.bfloat16)
    arrival = steps.dispatch_gemm_tiles(rt, cfg, n)
    by_expert = torch.from_numpy(grouped_tiles(rt.layout.expert_counts, cfg.block_m, cfg.block_n, n, group_m=cfg.group_m)).to(dev)  # fmt: skip
    programs = num_sms(x.device) - cfg.comm_sms
    gathered = {"slots": rt.slots, "records": recv_records}
    waits = {"flags": ws.chunk_flags, "epoch": epoch, "err_addr": ws.error_address,
             "budget": wait_budget(cfg.timeout_s), "fast_signals": FAST_SIGNALS}  # fmt: skip
    recv_x = recv_tokens[moe._handle(rt, recv_records, T, cfg)._token_rows]
    ends = torch.tensor(rt.layout.expert_counts, device=dev).cumsum(0).to(torch.int32)
    for name, a, tiles, extra in (
        ("GEMM: fused as run (gathered A, arrival order, waits)", recv_tokens, arrival, {**gathered, **waits}),
        ("GEMM: no waits", recv_tokens, arrival, gathered),
        ("GEMM: no waits, tiles by expert (group_m reuse)", recv_tokens, by_expert, gathered),
        ("GEMM: contiguous A by TMA, tiles by expert", recv_x, by_expert, {}),
    ):  # fmt: skip
        timed(name, lambda a=a, tiles=tiles, extra=extra: launch_grouped_gemm(a, w1, tiles, cfg, programs, out=out, **extra))  # fmt: skip
    timed("GEMM: torch._grouped_mm", lambda: torch._grouped_mm(recv_x, w1, offs=ends))
    flop = 2.0 * rt.layout.recv_rows * H * n
    return [f"rank {rank} {name:58} {ms:8.3f} ms" + (f" {flop / ms / 1e9:5.0f} TFLOP/s" if name.startswith("GEMM") else "")
            for name, ms in rows]  # fmt: skip


def _body(rank: int, world: int, sections: tuple[str, ...]) -> list[str]:
    lines = _dispatch_steps(rank, world) if "dispatch" in sections else []
    if "fused" in sections:
        lines += _fused_ablation(rank, world)
    if rank == 0 and "gemm" in sections:
        lines += _gemm_rows(rank, world)
    return lines


def main() -> None:
    """``python -m bench.experiments.ablate_moe [gemm] [dispatch] [fused]``: the sections
    named (all of them without one)."""
    import sys

    sections = tuple(a for a in sys.argv[1:] if a in ("gemm", "dispatch", "fused")) or (
        "gemm", "dispatch", "fused")  # fmt: skip
    world = min(torch.cuda.device_count(), 4)
    for lines in run_ranks(_body, world, sections, use_gpu=True, timeout_s=600):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
