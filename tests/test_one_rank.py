"""One rank: ag_gemm, gemm_rs and gemm_ar are ``x @ w`` (ops/paths.LocalGemm).

On a group of one rank an all-gather, a reduce-scatter or an all-reduce moves
nothing, so each op must be torch's product alone: the same bits as
torch.matmul, from torch's mm and no other torch op (no collective of one
rank, no gathered buffer, no copy), no workspace and no collective of ours
(each replaced by one that raises), and every input check as on more ranks.
Its host time is measured by the benchmark (``python -m bench.host_time
--world 1``, ``bench/experiments/probe_plain_host.py``), not here.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import poisoned

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
DTYPES = (torch.float32, torch.bfloat16)
# (M, K, N): odd sizes, K whose rows TMA could not read in bf16 (13 * 2 bytes), one row.
SHAPES = ((7, 13, 5), (33, 64, 48), (1, 32, 40))
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


class TorchOps(TorchDispatchMode):
    """The torch ops run while it is on, by name (``aten.mm.default``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _refused(*args, **kwargs):
    raise AssertionError("a collective or a workspace on one rank")


@contextlib.contextmanager
def no_collective():
    """Every collective the ops could run, and every workspace, raises."""
    import torch.distributed as dist

    from overlap_kernels.ops import ag_gemm, gemm_ar, gemm_rs, plans
    from overlap_kernels.ops.reduce_details import run
    from overlap_kernels.runtime import collectives, workspace

    names = [(dist, n) for n in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                 "all_gather_single", "reduce_scatter_single", "barrier")
             if hasattr(dist, n)]  # fmt: skip
    names += [(collectives, "all_gather_single"), (collectives, "reduce_scatter_single"),
              (collectives, "collective"), (collectives, "start_collective"),
              (ag_gemm, "all_gather_single"), (ag_gemm, "collective"), (gemm_ar, "collective"),
              (gemm_rs, "reduce_scatter_single"), (gemm_rs, "start_collective"),
              (plans, "meet"), (workspace, "get_workspace"), (ag_gemm, "get_workspace"),
              (run, "get_workspace")]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for module, name in names:
            stack.enter_context(mock.patch.object(module, name, _refused))
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype])


def local_body(rank, world, use_gpu):
    """Each op at each dtype, shape and weight layout, with and without ``out``:
    torch.matmul's bits, from aten.mm alone on a repeated call; no workspace made."""
    import overlap_kernels as ok
    from overlap_kernels.runtime import workspace

    _, device = setup_rank(rank, use_gpu)
    checked = 0
    with no_collective():
        for dtype in DTYPES:
            for m, k, n in SHAPES:
                x = torch.randn(m, k, dtype=dtype, device=device)
                weight = torch.randn(n, k, dtype=dtype, device=device)  # nn.Linear layout
                for w in (weight.t(), weight.t().contiguous()):
                    want = bits(torch.matmul(x, w))
                    for op in OPS:
                        call = getattr(ok, op)
                        what = f"{op} {dtype} {m}x{k}x{n} w.stride() {w.stride()}"
                        assert torch.equal(bits(call(x, w)), want), what  # (makes the plan)
                        with TorchOps() as seen:
                            got = call(x, w)
                        assert torch.equal(bits(got), want) and seen.ops == ["aten.mm.default"], (
                            what,
                            seen.ops,
                        )
                        out = poisoned((m, n), dtype, device)
                        with TorchOps() as seen:
                            assert call(x, w, out=out) is out, what
                        assert torch.equal(bits(out), want) and seen.ops == ["aten.mm.out"], (
                            what,
                            seen.ops,
                        )
                        checked += 1
                    avg = ok.gemm_rs(x, w, reduce_op="avg")  # divided by one rank
                    assert torch.equal(bits(avg), want), f"gemm_rs avg {dtype} {m}x{k}x{n}"
                    product, gathered = ok.ag_gemm(x, w, return_gathered=True)
                    assert torch.equal(bits(product), want) and torch.equal(gathered, x)
                    assert gathered.data_ptr() != x.data_ptr()  # a new tensor, as on more ranks
    assert workspace._WORKSPACES == {}, "a workspace was made on one rank"
    return checked


def test_one_rank_is_torch_matmul_cpu():
    assert run_ranks(local_body, 1, False) == [len(DTYPES) * len(SHAPES) * 2 * len(OPS)]


@gpu_ranks(worlds=(1,), backends=("torch",))
def test_one_rank_is_torch_matmul_gpu(world, gpus, backend):
    cases = len(DTYPES) * len(SHAPES) * 2 * len(OPS)
    assert run_on_gpus(local_body, world, gpus, backend) == [cases]


def no_lookup_body(rank, world, use_gpu):
    """A call with no config or schedule finds no plan by its signature (what its host
    time over torch.matmul was): with and without out, return_gathered, gemm_rs's "avg"."""
    import overlap_kernels as ok
    from overlap_kernels.ops import ag_gemm, gemm_ar, gemm_rs

    _, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, device=device)
    w = torch.randn(16, 32, device=device).t()
    want = bits(torch.matmul(x, w))
    with contextlib.ExitStack() as stack:
        for module in (ag_gemm, gemm_ar, gemm_rs):
            stack.enter_context(mock.patch.object(module, "signature", _no_lookup))
            stack.enter_context(mock.patch.object(module, "plan_for", _no_lookup))
        for op in OPS:
            assert torch.equal(bits(getattr(ok, op)(x, w)), want), op
            out = poisoned((8, 16), x.dtype, device)
            assert getattr(ok, op)(x, w, out=out) is out and torch.equal(bits(out), want), op
        assert torch.equal(bits(ok.gemm_rs(x, w, reduce_op="avg")), want)
        product, gathered = ok.ag_gemm(x, w, return_gathered=True)
        assert torch.equal(bits(product), want) and torch.equal(gathered, x)
        assert gathered.data_ptr() != x.data_ptr()
    return True


def _no_lookup(*args, **kwargs):
    raise AssertionError("a plan looked up by its signature on one rank")


def test_one_rank_call_finds_no_plan_cpu():
    assert run_ranks(no_lookup_body, 1, False) == [True]


def refusals_body(rank, world, use_gpu):
    """On one rank, bad inputs raise as on more, on a plan's first call and on a
    repeated one (the call's own ``out``); nothing was launched or exchanged."""
    import overlap_kernels as ok
    from overlap_kernels import OverlapInputError
    from overlap_kernels.runtime import workspace
    from overlap_kernels.schedules import rounds

    _, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, device=device)
    w = torch.randn(32, 16, device=device)
    x_grad = torch.randn(8, 32, device=device, requires_grad=True)
    shared = torch.randn(8 * 32 + 8 * 16, device=device)  # x's storage, then room for out
    x_shared = shared[:256].view(8, 32)
    refused = 0
    with no_collective():
        for op in OPS:
            call = getattr(ok, op)
            call(x, w)  # the plan whose repeated calls check the outs below
            fused = "one_shot" if op == "gemm_ar" else "fused"
            cases = [  # (x, w, keywords, what the error says)
                (x, w.half(), {}, f"{op}: x is torch.float32 but w is torch.float16"),
                (x.t().contiguous().t(), w, {}, f"{op}: x must be contiguous"),
                (x, torch.randn(31, 16, device=device), {}, rf"{op}: x is \[M, K\]"),
                (x, w, {"out": torch.empty(3, 3, device=device)}, rf"{op}: out has shape \(3, 3\), expected \(8, 16\)"),
                (x, w, {"out": torch.empty(8, 16, device=device).half()}, f"{op}: out has dtype torch.float16"),
                (x, w, {"out": torch.empty(16, 8, device=device).t()}, f"{op}: out must be contiguous"),
                (x, w, {"out": [0.0]}, f"{op}: out must be a torch.Tensor"),
                (x_shared, w, {"out": shared[128:256].view(8, 16)}, f"{op}: out overlaps an input"),
                (x_grad, w, {}, f"{op}: an operand requires grad"),
                (x, w, {"config": {"path": fused}}, f"{op}: path='{fused}' cannot run: one rank"),
                (x, w, {"schedule": rounds(2)}, f"{op}: schedule is for 2 ranks, group has 1"),
                (x, w, {"config": {"bogus": 1}}, r"unknown .*Config field\(s\) \['bogus'\]"),
            ]  # fmt: skip
            for a, b, keywords, message in cases:
                with pytest.raises(OverlapInputError, match=message):
                    call(a, b, **keywords)
                refused += 1
            out = call(x_shared, w, out=shared[256:].view(8, 16))  # beside x in its storage: fine
            assert torch.equal(out, x_shared @ w), op
    assert workspace._WORKSPACES == {}
    return refused


def test_one_rank_refuses_bad_inputs_cpu():
    assert run_ranks(refusals_body, 1, False) == [12 * len(OPS)]


def moe_body(rank, world, use_gpu):
    """The MoE layer on one rank, its announcements (which would tell no peer) made to
    raise: dispatch + combine bring every token back, moe_mlp (both paths) is right."""
    import overlap_kernels as ok
    from overlap_kernels.ops.moe_details import transfer
    from overlap_kernels.reference import judge_moe, moe_mlp_reference

    _, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    t, h, e, k, f = 13, 32, 4, 2, 16
    x = torch.randn(t, h, dtype=dtype, device=device)
    topk_ids = torch.rand(t, e, device=device).topk(k).indices
    topk_ids[0, 1] = -1  # an unused slot
    weights = torch.rand(t, k, device=device).softmax(-1)
    w_gate_up = torch.randn(e, h, 2 * f, dtype=dtype, device=device) / h**0.5
    w_down = torch.randn(e, f, h, dtype=dtype, device=device) / f**0.5
    checked = 0
    with mock.patch.object(transfer, "exchange_ready", _refused):
        recv_x, handle = ok.moe_dispatch(x, topk_ids, weights, num_experts=e)
        ones = torch.ones_like(handle.recv_weights)
        handle.recv_weights = ones  # each token's rows summed unweighted: k copies of it
        back = ok.moe_combine(recv_x, handle)
        used = (topk_ids >= 0).sum(1, keepdim=True).to(dtype)
        assert torch.allclose(back.float(), (x * used).float(), rtol=1e-2, atol=1e-2)
        reference, plain = moe_mlp_reference(
            x.cpu(), topk_ids.cpu(), weights.cpu(), [w_gate_up.cpu()], [w_down.cpu()]
        )
        for path in ("unfused", "fused"):
            out = ok.moe_mlp(x, topk_ids, weights, w_gate_up, w_down, num_experts=e,
                             config={"path": path})  # fmt: skip
            verdict = judge_moe(out.cpu(), reference, plain)
            assert verdict.problem is None, (path, verdict)
            checked += 1
    return checked


def test_one_rank_moe_announces_nothing_cpu():
    assert run_ranks(moe_body, 1, False) == [2]


@gpu_ranks(worlds=(1,), backends=("torch",))
def test_one_rank_moe_announces_nothing_gpu(world, gpus, backend):
    assert run_on_gpus(moe_body, world, gpus, backend) == [2]


@gpu_ranks(worlds=(1,), backends=("torch",))
def test_one_rank_call_finds_no_plan_gpu(world, gpus, backend):
    assert run_on_gpus(no_lookup_body, world, gpus, backend) == [True]
