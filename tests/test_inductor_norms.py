"""The Inductor pass routes a decoder layer's reduction point, matmul -> sum
all-reduce -> residual add -> RMSNorm (torch's functional all-reduce; the norm
as ``F.rms_norm`` or written by hand, as Llama's RMSNorm is, or with the add and
the statistics in fp32, as vLLM's native fused_add_rms_norm is), to one fused op:
gemm_ar_rmsnorm, or all_reduce_rmsnorm where no matmul feeds the all-reduce.
Compiled, the result is the fused op's, bit for bit, and within float64's bounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ranks import gpu_ranks, run_on_gpus, setup_rank
from test_all_reduce import _gather
from test_integrations import _collectives, _route_and_watch

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_add_rmsnorm

EPS = 1e-5


def _by_hand(r, weight):  # Llama's RMSNorm: statistics in fp32, the weight after the cast back
    variance = r.float().pow(2).mean(-1, keepdim=True)
    return weight * (r.float() * torch.rsqrt(variance + EPS)).to(r.dtype)


def _functional(r, weight):
    return F.rms_norm(r, (r.shape[-1],), weight, EPS)


def _add_then(norm):
    def add_norm(s, residual, weight):
        r = s + residual
        return norm(r, weight), r

    return add_norm


def _fp32_add(s, residual, weight):
    """vLLM's native fused_add_rms_norm: the add in fp32, the statistics of that
    fp32 sum (not of the rounded new residual), the weight after the cast back."""
    x = s.float() + residual.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + EPS)).to(s.dtype) * weight, x.to(s.dtype)


ADD_NORMS = {
    "F.rms_norm": _add_then(_functional),
    "by hand": _add_then(_by_hand),
    "fp32 add": _fp32_add,
}


def norm_body(rank, world, use_gpu, dtype):
    import torch.distributed._functional_collectives as funcol

    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    route, graphs = _route_and_watch()
    group_name = dist.group.WORLD.group_name
    tokens, k_local, hidden = 5, 16, 32

    def reduced(p):
        return funcol.wait_tensor(funcol.all_reduce(p, "sum", group_name))

    x = torch.randn(tokens, k_local, dtype=dtype, device=device)
    w = torch.randn(hidden, k_local, dtype=dtype, device=device)  # nn.Linear's [N, K_local]
    residual = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    for t in (residual, weight):
        dist.broadcast(t, 0)
    checked = []
    for name, add_norm in ADD_NORMS.items():
        for fuse_gemm in (True, False):

            def layer(x, w, residual, weight, add_norm=add_norm, fuse_gemm=fuse_gemm):
                p = x @ w.t() if fuse_gemm else torch.relu(x @ w.t())
                return add_norm(reduced(p), residual, weight)

            before = len(route.normed)
            normed, summed = torch.compile(layer, fullgraph=True)(x, w, residual, weight)
            what = f"{name}, {'matmul' if fuse_gemm else 'relu(matmul)'}"
            assert route.normed[before:] == [1], (what, route.normed)
            op = "gemm_ar_rmsnorm" if fuse_gemm else "all_reduce_rmsnorm"
            ops = graphs[-1]
            assert ops[getattr(torch.ops.overlap_kernels, op).default] == 1, (what, ops)
            assert _collectives(ops) == {}, (what, ops)
            # The graph's eps: F.rms_norm's is rounded to fp32 in the graph.
            eps = float(torch.tensor(EPS, dtype=torch.float32)) if name == "F.rms_norm" else EPS
            if fuse_gemm:
                expected = ok.gemm_ar_rmsnorm(x, w.t(), residual, weight, eps)
                partials = _gather(dist, torch.matmul(x, w.t()))
            else:
                expected = ok.all_reduce_rmsnorm(torch.relu(x @ w.t()), residual, weight, eps)
                partials = _gather(dist, torch.relu(x @ w.t()))
            assert torch.equal(summed, expected[1]) and torch.equal(normed, expected[0]), what
            check_add_rmsnorm(
                normed.cpu(), summed.cpu(), partials, residual.cpu(), weight.cpu(), eps, what
            )
            checked.append(what)

    # Not this pattern: a product (not a sum) all-reduce, and a sum used beside the add.
    def other(x, w, residual, weight):
        s = reduced(x @ w.t())
        r = s + residual
        return _functional(r, weight), s

    before = len(route.normed)
    torch.compile(other, fullgraph=True)(x, w, residual, weight)
    assert route.normed[before:] == [0], route.normed
    return len(checked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_routes_a_reduction_point_to_the_fused_norm_cpu(dtype):
    assert run_ranks(norm_body, 2, False, dtype, timeout_s=900) == [6, 6]


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_inductor_routes_a_reduction_point_to_the_fused_norm_gpu(world, gpus, backend):
    assert (
        run_on_gpus(norm_body, world, gpus, backend, torch.bfloat16, timeout_s=900) == [6] * world
    )
