"""The MoE ops in models: ``torch.ops.overlap_kernels.moe_mlp`` (schema, fake,
torch.compile, its refusal to record gradients) and the differentiable
``functional.moe_dispatch`` / ``moe_combine`` (forward and gradients of a
dispatch -> expert -> combine chain against a float64 single-process
reference built from every rank's inputs), on CPU ranks and, behind the
``gpu`` marker, on GPUs."""

from __future__ import annotations

import math

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels.launch import run_ranks

_EPS32 = 2.0**-24  # fp32's unit roundoff


def _routing(tokens: int, k: int, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k]: distinct experts per token, about a quarter of the
    slots unused (-1) and token 0 with none; topk_weights [T, k], signed."""
    ids = torch.rand(tokens, num_experts).argsort(1)[:, :k]
    ids[torch.rand(tokens, k) < 0.25] = -1
    ids[:1] = -1
    return ids.to(device), torch.randn(tokens, k, device=device)


def _mlp_inputs(world: int, device, tokens: int = 6, hidden: int = 16, ffn: int = 8, k: int = 2):
    e_local = 2
    ids, weights = _routing(tokens, k, e_local * world, device)
    x = torch.randn(tokens, hidden, device=device)
    w_gate_up = torch.randn(e_local, hidden, 2 * ffn, device=device) / math.sqrt(hidden)
    w_down = torch.randn(e_local, ffn, hidden, device=device) / math.sqrt(ffn)
    return (x, ids, weights, w_gate_up, w_down), e_local * world


# ---- moe_mlp as a custom op --------------------------------------------------------


def moe_mlp_op_body(rank, world, use_gpu):
    """opcheck (schema, fake); the op's result is the Python op's, bit for bit,
    with the keyword knobs passed through; operands that require grad are
    refused before anything is sent; torch.compile(fullgraph, aot_eager) of a
    layer around the op gives the eager result; a compiled layer (no
    fullgraph) with the differentiable dispatch and combine gives eager's
    output and gradients."""
    from torch.library import opcheck

    import overlap_kernels as ok
    import overlap_kernels.integrations.autograd  # noqa: F401  (moe_mlp's autograd kernel)
    from overlap_kernels.integrations.torch_ops import name_of

    dist, device = setup_rank(rank, use_gpu)
    op, name = torch.ops.overlap_kernels.moe_mlp, name_of(None)
    checks = 0
    # The interpreter's template resolves "auto" to the fused path: both paths run.
    for kwargs in ({}, {"path": "unfused", "max_recv_tokens": 64}):
        args, num_experts = _mlp_inputs(world, device)
        opcheck(
            op.default,
            (*args, name, num_experts),
            kwargs,
            test_utils=("test_schema", "test_faketensor"),
        )
        config = {"max_recv_tokens": None, **kwargs} if kwargs else None
        expected = ok.moe_mlp(*args, None, num_experts=num_experts, config=config)
        assert torch.equal(op(*args, name, num_experts, **kwargs), expected), kwargs
        checks += 1

    args, num_experts = _mlp_inputs(world, device)
    for i in (0, 2, 3):  # x, topk_weights, w_gate_up
        leaves = [a.clone().requires_grad_(j == i) for j, a in enumerate(args)]
        with pytest.raises(
            ok.OverlapInputError, match="moe_mlp: an operand requires grad.*moe_dispatch"
        ):
            op(*leaves, name, num_experts)
        checks += 1
    with torch.no_grad():  # nothing is recorded: allowed
        assert torch.equal(op(*leaves, name, num_experts), op(*args, name, num_experts))

    def layer(x, ids, weights, w_gate_up, w_down):  # a residual MoE block
        return x + op(torch.nn.functional.rms_norm(x, (x.shape[1],)), ids, weights, w_gate_up, w_down, name,
                      num_experts, path="unfused")  # fmt: skip

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), layer(*args))
    args, _ = _mlp_inputs(world, device, tokens=5)  # another T: recompiled or dynamic, same answer
    assert torch.equal(compiled(*args), layer(*args))
    checks += 1

    # The differentiable dispatch and combine inside a compiled layer: they run
    # eagerly between the compiled pieces (graph breaks), with eager's results.
    import overlap_kernels.integrations.functional as F

    (x, ids, weights, experts, _), _ = _mlp_inputs(world, device)

    def trainable(x, weights, experts):
        recv_x, handle = F.moe_dispatch(
            torch.tanh(x), ids, weights.softmax(-1), num_experts=num_experts
        )
        ends = torch.tensor([0, *handle.expert_counts]).cumsum(0).tolist()
        y = torch.cat([recv_x[ends[e] : ends[e + 1]] @ experts[e] for e in range(experts.shape[0])])
        return 2 * F.moe_combine(torch.relu(y), handle)

    results = []
    for fn in (trainable, torch.compile(trainable, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (x, weights, experts)]
        out = fn(*leaves)
        out.sum().backward()
        results.append([out.detach(), *(t.grad for t in leaves)])
    for name, eager, compiled in zip(("out", "dx", "dw", "dW"), *results):
        assert torch.equal(eager, compiled), name
    return checks + 1


@pytest.mark.parametrize("world", [1, 2])
def test_moe_mlp_op_cpu(world):
    assert run_ranks(moe_mlp_op_body, world, False) == [7] * world


@gpu_ranks(worlds=(1, 2), backends=("torch",))
def test_moe_mlp_op_gpu(world, gpus, backend):
    assert run_on_gpus(moe_mlp_op_body, world, gpus, backend) == [7] * world


# ---- differentiable dispatch and combine ---------------------------------------------


def _chain64(xs, ids, weights, experts, grads):
    """float64, one process: out[t] = sum_j w[t, j] x[t] @ W[ids[t, j]] for
    every rank's tokens (concatenated), and the gradients of <out, grads> in x,
    w and W. Returns (out, dx, dw, dW)."""
    x = torch.cat(xs).double().requires_grad_()
    w = torch.cat(weights).double().requires_grad_()
    big_w = torch.cat(experts).double().requires_grad_()  # [E, H, N], experts in global order
    ids = torch.cat(ids).long()
    used = (ids >= 0).double()
    per_slot = torch.einsum("th,tkhn->tkn", x, big_w[ids.clamp(min=0)])  # [T, k, N]
    out = ((w * used)[:, :, None] * per_slot).sum(1)
    (out * torch.cat(grads).double()).sum().backward()
    return out.detach(), x.grad, w.grad, big_w.grad


def chain_body(rank, world, use_gpu):
    """recv_x, handle = moe_dispatch(x, ...); y = recv_x @ W[e] per local
    expert; out = moe_combine(y, handle): out and the gradients of x,
    topk_weights and W against float64, for a random output gradient and for
    out.sum() (an expanded one).

    Tolerance: out, dx, dw and dW are sums of products of the inputs (the
    chain is linear in each), computed in fp32 through at most
    D = H + N + P + k + W + 4 roundings (P: all routed pairs, the longest sum
    being an expert's weight gradient over its rows), so each element is off
    by at most gamma_D ~ D * 2^-24 times the sum of its terms' magnitudes,
    which is the same chain run on |inputs| (_chain64 of the absolute values).
    Twice that bound allows any summation order. A wrong, missing or extra
    term is off by a whole term, at least 1/P of that sum; unused slots'
    weight gradients must be exactly 0."""
    import overlap_kernels as ok
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    tokens, hidden, n, k, e_local = 5 + rank, 16, 8, 3, 2
    num_experts = e_local * world
    checked = 0
    for expanded in (False, True):
        ids, w0 = _routing(tokens, k, num_experts, device)
        x = torch.randn(tokens, hidden, device=device).requires_grad_()
        w = w0.requires_grad_()
        experts = (
            torch.randn(e_local, hidden, n, device=device) / math.sqrt(hidden)
        ).requires_grad_()

        recv_x, handle = F.moe_dispatch(
            x, ids, w, num_experts=num_experts, config={"timeout_s": 20.0}
        )
        assert recv_x.grad_fn is not None and recv_x.shape[0] == sum(handle.expert_counts)
        ends = torch.tensor([0, *handle.expert_counts]).cumsum(0).tolist()
        y = torch.cat([recv_x[ends[e] : ends[e + 1]] @ experts[e] for e in range(e_local)])
        out = F.moe_combine(y, handle)
        g = torch.ones_like(out) if expanded else torch.randn_like(out)
        out.sum().backward() if expanded else out.backward(g)

        parts = [None] * world
        mine = tuple(t.detach().cpu() for t in (x, ids, w, experts, g))
        dist.all_gather_object(parts, mine)
        xs, idss, ws, ex, gs = (list(c) for c in zip(*parts))
        ref = _chain64(xs, idss, ws, ex, gs)
        magnitude = _chain64(
            [a.abs() for a in xs],
            idss,
            [a.abs() for a in ws],
            [a.abs() for a in ex],
            [a.abs() for a in gs],
        )
        pairs = sum(int((i >= 0).sum()) for i in idss)
        bound_scale = 2 * (hidden + n + pairs + k + world + 4) * _EPS32
        start = sum(a.shape[0] for a in xs[:rank])
        rows, experts_mine = (
            slice(start, start + tokens),
            slice(rank * e_local, (rank + 1) * e_local),
        )
        results = {
            "out": (out, rows),
            "dx": (x.grad, rows),
            "dw": (w.grad, rows),
            "dW": (experts.grad, experts_mine),
        }
        for i, (name, (got, sel)) in enumerate(results.items()):
            want, allowed = ref[i][sel], bound_scale * magnitude[i][sel]
            assert got is not None and got.shape == want.shape, f"{name}: shape"
            got = got.detach().double().cpu()
            excess = (got - want).abs() - allowed
            assert not got.isnan().any() and excess.max() <= 0, (
                f"{name} (expanded={expanded}) off by {(got - want).abs().max():.3g}; "
                f"bound at the worst element {allowed.reshape(-1)[excess.argmax()]:.3g}"
            )
        assert (w.grad[ids < 0] == 0).all(), "unused slots' weight gradients"
        checked += 1

    # A plain MoeHandle (the op's) cannot differentiate: refused before anything is sent.
    x = torch.randn(tokens, hidden, device=device)
    ids, w = _routing(tokens, k, num_experts, device)
    recv_x, plain = ok.moe_dispatch(x, ids, w, num_experts=num_experts)
    with pytest.raises(
        ok.OverlapInputError, match="moe_combine: y requires grad.*functional.moe_dispatch"
    ):
        F.moe_combine(recv_x.clone().requires_grad_(), plain)
    assert torch.equal(
        F.moe_combine(recv_x, plain), ok.moe_combine(recv_x, plain)
    )  # no grad: allowed
    return checked + 1


@pytest.mark.parametrize("world", [2, 4])
def test_moe_dispatch_combine_gradients_cpu(world):
    assert run_ranks(chain_body, world, False) == [3] * world


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_moe_dispatch_combine_gradients_gpu(world, gpus, backend):
    assert run_on_gpus(chain_body, world, gpus, backend) == [3] * world
