"""The CPU demo: every op on emulated ranks, checked against an fp64 reference.

``python -m overlap_kernels.demo`` (or ``python -m bench`` on a machine with no
GPU) starts 4 rank processes that talk through gloo and shared-memory files,
runs in Triton's interpreter ag_gemm with each schedule factory and mechanism,
gemm_rs with each reduction mechanism, gemm_ar on both fused paths, the
reduction point with residual add and RMSNorm (all_reduce_rmsnorm,
gemm_ar_rmsnorm), the MoE layer (fused and unfused) and dispatch/combine
round trip, and
prints one line per case: op and schedule, dtype, the relative error against
float64, the error the plain algorithm makes in the same dtype, and whether it
passed the tests' checks (overlap_kernels/reference.py: at most twice the
plain algorithm's error overall, and a bound on every element).
"""

from __future__ import annotations

import sys
import time

import torch

from .launch import run_ranks

WORLD = 4


def _cases():
    from . import schedules as s

    return [
        ("ring", s.ring, s.COPY_ENGINE, 1),
        ("direct", s.direct, s.COPY_ENGINE, 1),
        ("bidirectional", s.bidirectional, s.COPY_ENGINE, 2),
        ("ring", s.ring, s.SM_COPY, 2),
        ("direct", s.direct, s.SM_COPY, 3),
    ]


def _gather(x: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts


def _reduce_cases(rank: int, world: int) -> list[tuple]:
    """gemm_rs (push, copy-engine pull) and gemm_ar (one_shot, two_shot) on 30 rows:
    ragged for every tile size and for the world size."""
    from . import gemm_ar, gemm_rs
    from .ops.reduce_details.plan import segment
    from .reference import judge_reduced_matmul

    cases = [
        ("gemm_rs/push/x2", lambda x, w: gemm_rs(x, w, config={"path": "fused", "mechanism": "push", "pieces": 2})),
        ("gemm_rs/copy_engine/avg", lambda x, w: gemm_rs(
            x, w, config={"path": "fused", "mechanism": "copy_engine", "comm_sms": 1}, reduce_op="avg")),
        ("gemm_ar/one_shot", lambda x, w: gemm_ar(x, w, config={"path": "one_shot"})),
        ("gemm_ar/two_shot/x2", lambda x, w: gemm_ar(x, w, config={"path": "two_shot", "pieces": 2})),
    ]  # fmt: skip
    rows = []
    for label, call in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(30, 48, dtype=dtype)  # this rank's K slice
            w = torch.randn(72, 48, dtype=dtype).t()  # nn.Linear layout
            begin = time.perf_counter()
            out = call(x, w)
            seconds = time.perf_counter() - begin
            xs, ws = _gather(x), _gather(w.contiguous())
            if label.endswith("avg"):
                out = out * world  # judged as the sum it scales
            if label.startswith("gemm_rs"):
                start, stop = segment(rank, x.shape[0], world)
                xs = [part[start:stop] for part in xs]
            verdict = judge_reduced_matmul(out, xs, ws)
            rows.append((label, str(dtype).removeprefix("torch."), verdict.error, verdict.plain_error,
                         verdict.problem is None, seconds))  # fmt: skip
    return rows


def _norm_cases(rank: int, world: int) -> list[tuple]:
    """A decoder layer's reduction point (one-shot all-reduce, residual add, RMSNorm),
    with and without the GEMM in front, on 9 rows of 40: every element of both
    outputs within reference.check_add_rmsnorm's bounds; the error shown is normed's."""
    import torch.distributed as dist

    from . import all_reduce_rmsnorm, gemm_ar_rmsnorm
    from .reference import check_add_rmsnorm, relative_error, rmsnorm_reference

    rows = []
    config = {"path": "one_shot", "block_cols": 16}
    for label in ("all_reduce_rmsnorm", "gemm_ar_rmsnorm"):
        for dtype in (torch.bfloat16, torch.float32):
            x, w = torch.randn(9, 24, dtype=dtype), torch.randn(40, 24, dtype=dtype).t()
            partial = x @ w if label == "gemm_ar_rmsnorm" else torch.randn(9, 40, dtype=dtype)
            residual, weight = torch.randn(9, 40, dtype=dtype), torch.rand(40, dtype=dtype) + 0.5
            for t in (residual, weight):
                dist.broadcast(t, 0)
            begin = time.perf_counter()
            if label == "gemm_ar_rmsnorm":
                normed, summed = gemm_ar_rmsnorm(x, w, residual, weight, 1e-5, config=config)
            else:
                normed, summed = all_reduce_rmsnorm(partial, residual, weight, 1e-5, config=config)
            seconds = time.perf_counter() - begin
            parts = _gather(partial)
            exact = sum(p.double() for p in parts) + residual.double()
            reference = rmsnorm_reference(exact, weight, 1e-5)
            # The plain algorithm: the sum rounded (as NCCL returns it), the residual added, normed.
            plain_sum = (sum(p.float() for p in parts).to(dtype).float() + residual.float()).to(
                dtype
            )
            plain = rmsnorm_reference(plain_sum, weight, 1e-5).to(dtype)
            try:
                check_add_rmsnorm(normed, summed, parts, residual, weight, 1e-5, label)
                ok = True
            except AssertionError:
                ok = False
            rows.append((label, str(dtype).removeprefix("torch."), relative_error(normed, reference),
                         relative_error(plain, reference), ok, seconds))  # fmt: skip
    return rows


def _moe_cases(rank: int, world: int) -> list[tuple]:
    """moe_mlp, fused and unfused, on 13 tokens per rank with top-3 of 8 experts
    (one slot unused), and the dispatch/combine round trip (exact copies)."""
    import torch.distributed as dist

    from . import moe_combine, moe_dispatch, moe_mlp
    from .reference import judge_moe, moe_mlp_reference, relative_error

    rows = []
    num_experts, e_local = 2 * world, 2
    for path in ("fused", "unfused"):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(13, 32, dtype=dtype)
            topk_ids = torch.stack([torch.randperm(num_experts)[:3] for _ in range(13)])
            topk_ids[0, 1] = -1
            topk_weights = torch.rand(13, 3)
            w_gate_up = torch.randn(e_local, 32, 48, dtype=dtype) / 6
            w_down = torch.randn(e_local, 24, 32, dtype=dtype) / 5
            gate_ups, downs = [None] * world, [None] * world
            dist.all_gather_object(gate_ups, w_gate_up)
            dist.all_gather_object(downs, w_down)
            begin = time.perf_counter()
            out = moe_mlp(
                x,
                topk_ids,
                topk_weights,
                w_gate_up,
                w_down,
                num_experts=num_experts,
                config={"path": path},
            )
            seconds = time.perf_counter() - begin
            verdict = judge_moe(out, *moe_mlp_reference(x, topk_ids, topk_weights, gate_ups, downs))
            rows.append((f"moe_mlp/{path}", str(dtype).removeprefix("torch."), verdict.error, verdict.plain_error,
                         verdict.problem is None, seconds))  # fmt: skip
    x = torch.randn(13, 32)
    topk_ids = torch.stack([torch.randperm(num_experts)[:3] for _ in range(13)])
    topk_weights = torch.rand(13, 3)
    begin = time.perf_counter()
    recv_x, handle = moe_dispatch(x, topk_ids, topk_weights, num_experts=num_experts)
    out = moe_combine(recv_x, handle)
    seconds = time.perf_counter() - begin
    reference = x.double() * topk_weights.double().sum(1, keepdim=True)
    error = relative_error(out, reference)
    rows.append(("moe_dispatch+combine", "float32", error, 0.0, error < 1e-6, seconds))
    return rows


def _rank_main(rank: int, world: int) -> list[tuple]:
    from . import ag_gemm, schedules
    from .reference import judge_matmul

    torch.manual_seed(1000 + rank)
    rows = []
    for name, factory, mechanism, pieces in _cases():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(21, 96, dtype=dtype)  # 21 rows per rank: ragged for every tile size
            w = torch.randn(80, 96, dtype=dtype).t()  # nn.Linear layout
            schedule = schedules.split(schedules.with_mechanism(factory(world), mechanism), pieces)
            begin = time.perf_counter()
            out = ag_gemm(x, w, schedule=schedule, config={"path": "fused", "comm_sms": 2})
            seconds = time.perf_counter() - begin
            verdict = judge_matmul(out, torch.cat(_gather(x)), w)
            passed = verdict.problem is None
            label = f"ag_gemm/{name}/{mechanism}/x{pieces}"
            rows.append(
                (
                    label,
                    str(dtype).removeprefix("torch."),
                    verdict.error,
                    verdict.plain_error,
                    passed,
                    seconds,
                )
            )
    return rows + _reduce_cases(rank, world) + _norm_cases(rank, world) + _moe_cases(rank, world)


def main(world: int = WORLD) -> int:
    print(
        f"overlap_kernels CPU demo: every op on {world} emulated ranks (Triton interpreter, gloo, shared memory)"
    )
    print("ag_gemm: x [21, 96] per rank, w [96, 80]; reference: float64 all_gather(x) @ w")
    print(
        "gemm_rs, gemm_ar: x [30, 48] and w [48, 72] per rank; reference: float64 sum over ranks of x @ w"
    )
    print(
        "all_reduce_rmsnorm, gemm_ar_rmsnorm: [9, 40] per rank (gemm: x [9, 24], w [24, 40]), a replicated"
        " residual and norm weight; reference: float64 rmsnorm(sum + residual) * weight"
    )
    print(
        "moe: 13 tokens [13, 32] per rank, top-3 of 8 experts, expert MLP 32 -> 24 -> 32; reference: float64\n"
    )
    results = run_ranks(_rank_main, world)
    header = f"{'op/schedule/mechanism/pieces':<40}{'dtype':<10}{'rel. error':>12}{'plain err':>12}{'ok':>5}{'s':>7}"
    print(header)
    print("-" * len(header))
    all_ok = True
    for case in range(len(results[0])):
        # Worst rank for each case.
        name, dtype, err, plain_err, _, seconds = max(
            (r[case] for r in results), key=lambda row: row[2]
        )
        ok = all(r[case][4] for r in results)
        all_ok &= ok
        print(
            f"{name:<40}{dtype:<10}{err:>12.2e}{plain_err:>12.2e}{'yes' if ok else 'NO':>5}{seconds:>7.2f}"
        )
    print("\nall cases correct" if all_ok else "\nSOME CASES FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
