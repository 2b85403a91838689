"""The custom ops (torch.ops.overlap_kernels), their gradients and the
functional TP layers: schemas and fakes (opcheck), forward and backward
against float64 references on 2 and 3 CPU ranks (one peer, several; GPUs: 2
and 4), and torch.compile."""

from __future__ import annotations

import pytest
import torch
from ranks import OurOpCalls, gpu_ranks, run_on_gpus, setup_rank
from test_ag_gemm import _gather
from test_gemm_rs_ar import _rows, check_sum

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul


def test_ops_are_registered_with_fixed_strides():
    import overlap_kernels.integrations.torch_ops  # noqa: F401

    for name in ("ag_gemm", "gemm_rs", "gemm_ar", "ag_gemm_out", "gemm_rs_out", "gemm_ar_out"):
        op = getattr(torch.ops.overlap_kernels, name).default
        assert torch.Tag.needs_fixed_stride_order in op.tags, name
    assert (
        torch.ops.overlap_kernels.all_gather.default
        and torch.ops.overlap_kernels.reduce_scatter.default
    )
    assert "Tensor(a!) out" in str(torch.ops.overlap_kernels.gemm_rs_out.default._schema)


def opcheck_body(rank, world, use_gpu):
    from torch.library import opcheck

    import overlap_kernels.integrations.functional  # noqa: F401  (the gradients)
    from overlap_kernels.integrations.torch_ops import name_of

    dist, device = setup_rank(rank, use_gpu)
    ops, name = torch.ops.overlap_kernels, name_of(None)

    def t(*shape, grad=False):
        return torch.randn(*shape, device=device).requires_grad_(grad)

    w = t(32, 16, grad=True)
    cases = [
        (ops.ag_gemm.default, (t(8, 32, grad=True), w, name), {}),
        (ops.ag_gemm.default, (t(8, 32, grad=True), w, name), {"return_gathered": True}),
        (ops.gemm_rs.default, (t(16, 32, grad=True), w, name), {}),
        (
            ops.gemm_rs.default,
            (t(4 * world + 1, 32, grad=True), w, name),
            {"reduce_op": "avg"},
        ),  # uneven slices
        (ops.gemm_ar.default, (t(16, 32, grad=True), w, name), {}),
        (ops.ag_gemm_out.default, (t(8, 32), w.detach(), name), {"out": t(8 * world, 16)}),
        (ops.gemm_rs_out.default, (t(16, 32), w.detach(), name), {"out": t(16 // world, 16)}),
        (ops.gemm_ar_out.default, (t(16, 32), w.detach(), name), {"out": t(16, 16)}),
        (ops.all_gather.default, (t(8, 32), name), {}),
        (ops.reduce_scatter.default, (t(4 * world, 32), name), {}),
        (ops.ag_gemm_regathered_grads.default, (t(8 * world, 16), t(8, 32), w.detach(), name), {}),
    ]
    for op, args, kwargs in cases:
        opcheck(
            op,
            args,
            kwargs,
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )
    return len(cases)


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck_cpu(world):
    assert run_ranks(opcheck_body, world, False) == [11] * world


def _bias_grad_ok(bias_grad, g):
    """bias.grad == g summed over rows: fp32 sums of M terms differ from the
    fp64 sum by at most M unit roundoffs of the sum of magnitudes."""
    exact = g.double().sum(0)
    bound = g.shape[0] * 2.0**-24 * g.double().abs().sum(0)
    return bool(((bias_grad.double() - exact).abs() <= bound).all())


def autograd_body(rank, world, use_gpu, compiled=False):
    """Each functional layer's output and x, weight, bias gradients against
    float64, for a random output gradient and an expanded one (y.sum());
    ``compiled``: each layer under torch.compile(fullgraph=True)."""
    from types import SimpleNamespace

    import overlap_kernels.integrations.functional as functional

    F = functional
    if compiled:
        F = SimpleNamespace(**{name: torch.compile(getattr(functional, name), fullgraph=True, backend="aot_eager")
                               for name in ("linear_ag", "linear_rs", "linear_ar")})  # fmt: skip
    dist, device = setup_rank(rank, use_gpu)
    tokens, k, n = 8, 32, 16  # tokens per rank (ag), features; weight [n, k] as nn.Linear

    def leaf(*shape):
        return torch.randn(*shape, device=device).requires_grad_()

    checked = 0
    for expanded in (False, True):
        # Column-parallel with sequence parallelism: all-gather then GEMM.
        x, weight, bias = leaf(tokens, k), leaf(n, k), leaf(n)
        y = F.linear_ag(x, weight, bias)
        # (y - bias: one rounding more than the product, far inside the product's bound)
        check_matmul(
            y.detach() - bias.detach(), _gather(dist, x.detach()), weight.detach().t(), "linear_ag"
        )
        g = torch.ones_like(y) if expanded else torch.randn_like(y)
        y.sum().backward() if expanded else y.backward(g)
        check_sum(
            dist,
            x.grad,
            g,
            weight.detach(),
            _rows(rank, tokens * world, world),
            what="linear_ag dx",
        )
        check_matmul(weight.grad, g.t(), _gather(dist, x.detach()), "linear_ag dweight")
        assert _bias_grad_ok(bias.grad, g), "linear_ag dbias"

        # Row-parallel with sequence parallelism: GEMM then reduce-scatter.
        x, weight, bias = leaf(tokens * world, k), leaf(n, k), leaf(n)
        y = F.linear_rs(x, weight, bias)
        check_sum(dist, y.detach() - bias.detach(), x.detach(), weight.detach().t(), _rows(rank, tokens * world, world),
                  what="linear_rs")  # fmt: skip
        g = torch.ones_like(y) if expanded else torch.randn_like(y)
        y.sum().backward() if expanded else y.backward(g)
        g_all = _gather(dist, g)
        check_matmul(x.grad, g_all, weight.detach(), "linear_rs dx")
        check_matmul(weight.grad, g_all.t(), x.detach(), "linear_rs dweight")
        assert _bias_grad_ok(bias.grad, g), "linear_rs dbias"

        # Row-parallel, replicated output: GEMM then all-reduce, any leading dims.
        x, weight = leaf(2, tokens, k), leaf(n, k)
        y = F.linear_ar(x, weight)
        assert y.shape == (2, tokens, n)
        check_sum(
            dist,
            y.detach().reshape(-1, n),
            x.detach().reshape(-1, k),
            weight.detach().t(),
            what="linear_ar",
        )
        g = torch.ones_like(y) if expanded else torch.randn_like(y)
        dist.broadcast(g, src=0)  # the output is replicated, and so is its gradient
        y.sum().backward() if expanded else y.backward(g)
        check_matmul(x.grad.reshape(-1, k), g.reshape(-1, n), weight.detach(), "linear_ar dx")
        check_matmul(
            weight.grad, g.reshape(-1, n).t(), x.detach().reshape(-1, k), "linear_ar dweight"
        )
        checked += 3

    # The gathered x returned and used downstream: its gradient is reduce-scattered into dx.
    from overlap_kernels.integrations.torch_ops import name_of

    x, weight = leaf(tokens, k), leaf(n, k)
    y, gathered = torch.ops.overlap_kernels.ag_gemm(
        x, weight.t(), name_of(None), return_gathered=True
    )
    g, h = torch.randn_like(y), torch.randn_like(gathered)
    torch.autograd.backward([y, gathered], [g, h])
    # dx = (sum over ranks of g @ weight + h)[this rank's rows] = [g, h] @ [weight; I], summed
    eye = torch.eye(k, device=device)
    check_sum(dist, x.grad, torch.cat([g, h], 1), torch.cat([weight.detach(), eye]), _rows(rank, tokens * world, world),
              what="ag_gemm dx with the gathered x used")  # fmt: skip
    check_matmul(
        weight.grad.t(), gathered.detach().t(), g, "ag_gemm dweight from the returned gathered x"
    )
    return checked + 1


def kept_or_regathered_body(rank, world, use_gpu):
    """linear_ag's backward with the gathered x kept (its only communication is
    gemm_rs) and with x alone kept (gathered again, beside the dx product), each
    with and without x's gradient: the ops it runs, and its gradients against float64."""
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    tokens, k, n = 8, 32, 16
    expected = {
        (True, True): ["gemm_rs"],
        (False, True): ["ag_gemm_regathered_grads"],
        (True, False): [],
        (False, False): ["all_gather"],
    }
    for (keep, x_grad), ops in expected.items():
        x = torch.randn(tokens, k, device=device).requires_grad_(x_grad)
        weight = torch.randn(n, k, device=device).requires_grad_()
        y = F.linear_ag(x, weight, keep_gathered=keep)
        g = torch.randn_like(y)
        with OurOpCalls() as seen:
            y.backward(g)
        ran = dict(seen.calls)
        assert ran == dict.fromkeys(ops, 1), f"keep_gathered={keep}, x grad {x_grad}: ran {ran}"
        what = f"linear_ag keep_gathered={keep}"
        check_matmul(weight.grad, g.t(), _gather(dist, x.detach()), f"{what} dweight")
        if x_grad:
            rows = _rows(rank, tokens * world, world)
            check_sum(dist, x.grad, g, weight.detach(), rows, what=f"{what} dx")

    # Gathered again under torch.compile: the custom op traces and gives the same gradients.
    compiled = torch.compile(F.linear_ag, fullgraph=True, backend="aot_eager")
    x = torch.randn(tokens, k, device=device).requires_grad_()
    weight = torch.randn(n, k, device=device).requires_grad_()
    y = compiled(x, weight, keep_gathered=False)
    g = torch.randn_like(y)
    y.backward(g)
    check_matmul(weight.grad, g.t(), _gather(dist, x.detach()), "compiled re-gather dweight")
    check_sum(dist, x.grad, g, weight.detach(), _rows(rank, tokens * world, world),
              what="compiled re-gather dx")  # fmt: skip

    # Traced, the gathered x is asked for only where autograd records (the op copies it out).
    asked = []

    def watch(gm, example_inputs):
        asked.extend(
            n.kwargs.get("return_gathered") for n in gm.graph.nodes if "ag_gemm" in str(n.target)
        )
        return gm.forward

    traced = torch.compile(F.linear_ag, fullgraph=True, backend=watch)
    with torch.no_grad():
        traced(x, weight)
    traced(x, weight)
    assert asked == [False, True], asked

    # Only the returned gathered x used: dx is its gradient's reduce-scatter, no dweight.
    from overlap_kernels.integrations.torch_ops import name_of

    x = torch.randn(tokens, k, device=device).requires_grad_()
    weight = torch.randn(n, k, device=device).requires_grad_()
    _, gathered = torch.ops.overlap_kernels.ag_gemm(
        x, weight.t(), name_of(None), return_gathered=True
    )
    h = torch.randn_like(gathered)
    gathered.backward(h)
    eye = torch.eye(k, device=device)
    check_sum(dist, x.grad, h, eye, _rows(rank, tokens * world, world),
              what="dx from the gathered x alone")  # fmt: skip
    assert weight.grad is None, "no dweight when the product is unused"
    return len(expected) + 2


@pytest.mark.parametrize("world", [2, 3])
def test_linear_ag_keeps_the_gathered_x_or_gathers_again_cpu(world):
    assert run_ranks(kept_or_regathered_body, world, False) == [6] * world


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_linear_ag_keeps_the_gathered_x_or_gathers_again_gpu(world, gpus, backend):
    assert run_on_gpus(kept_or_regathered_body, world, gpus, backend) == [6] * world


@pytest.mark.parametrize("world", [2, 3])
def test_layers_forward_and_backward_cpu(world):
    assert run_ranks(autograd_body, world, False) == [7] * world


def test_compiled_layers_forward_and_backward_cpu():
    assert run_ranks(autograd_body, 2, False, True) == [7, 7]


def uneven_backward_body(rank, world, use_gpu):
    import overlap_kernels as ok
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(2 * world + 1, 16, device=device, requires_grad=True)
    y = F.linear_rs(x, torch.randn(8, 16, device=device))
    with pytest.raises(
        ok.OverlapInputError, match=r"gemm_rs backward: .* M = 5 must divide by the group size 2"
    ):
        y.sum().backward()
    return True


def test_uneven_gemm_rs_backward_is_refused_before_sending_cpu():
    assert run_ranks(uneven_backward_body, 2, False) == [True, True]


def compiled_body(rank, world, use_gpu):
    """A sequence-parallel MLP block (ag_gemm, relu, gemm_rs) compiled whole
    (fullgraph, aot_eager): the same output and gradients as eager, bit for
    bit where both run the same kernels (the interpreter's templates name
    their paths; CUDA's measure and may switch between calls), and both
    within fp32's bounds (:func:`_mlp_bounds`) of the float64 block built from
    every rank's tokens and weight shards."""
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    hidden, ffn_local, tokens = 32, 16, 8

    def block(x, w_up, w_down):
        return F.linear_rs(torch.relu(F.linear_ag(x, w_up)), w_down)

    inputs = [
        torch.randn(tokens, hidden),
        torch.randn(ffn_local, hidden),
        torch.randn(hidden, ffn_local),
    ]
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().to(device).requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.sum().backward()
        results.append([y.detach(), *(t.grad for t in leaves)])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)

    # The whole block in float64: every rank's tokens, the weights' shards joined.
    x_full, w_up_full = (_gather(dist, t).double() for t in inputs[:2])  # (rows joined)
    w_down_full = _gather(dist, inputs[2].t().contiguous()).t().double()
    g_full = torch.ones(world * tokens, hidden, dtype=torch.float64)  # y.sum()'s gradient
    zero = [(torch.zeros_like(w_up_full), None), (torch.zeros_like(w_down_full), None)]
    bounds = _mlp_bounds(x_full, [(w_up_full, None), (w_down_full, None)], zero, g_full)
    x64, w_up64, w_down64 = (t.clone().requires_grad_() for t in (x_full, w_up_full, w_down_full))
    y64 = torch.relu(x64 @ w_up64.t()) @ w_down64.t()
    y64.backward(g_full)
    rows, shard = (
        _rows(rank, world * tokens, world),
        slice(rank * ffn_local, (rank + 1) * ffn_local),
    )
    for what, (y, dx, dw_up, dw_down) in zip(("eager", "compiled"), results):
        _assert_within(y, y64[rows], bounds["y"][rows], f"{what} y")
        _assert_within(dx, x64.grad[rows], bounds["dx"][rows], f"{what} dx")
        _assert_within(dw_up, w_up64.grad[shard], bounds["0.weight"][shard], f"{what} dw_up")
        _assert_within(dw_down, w_down64.grad[:, shard], bounds["2.weight"][:, shard],
                       f"{what} dw_down")  # fmt: skip
    return True


def test_compiled_mlp_block_matches_eager_cpu():
    assert run_ranks(compiled_body, 2, False) == [True, True]


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_layers_forward_and_backward_gpu(world, gpus, backend):
    assert run_on_gpus(autograd_body, world, gpus, backend) == [7] * world


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_compiled_layers_forward_and_backward_gpu(world, gpus, backend):
    assert run_on_gpus(autograd_body, world, gpus, backend, True) == [7] * world


def _without_compile_caches() -> None:
    """Compile afresh: a graph found in Inductor's or AOTAutograd's on-disk
    caches skips the post-grad passes, so the pass would see (and count) nothing."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def inductor_body(rank, world, use_gpu):
    """An MLP block written with torch's functional collectives (as DTensor
    emits them), compiled by Inductor with our pass: the gathers and
    reduce-scatters around its matmuls become ag_gemm / gemm_rs in the forward
    and the backward graph, and the output and gradients are those of the same
    block written with our functional layers, run eagerly."""
    import torch.distributed._functional_collectives as funcol

    import overlap_kernels.integrations.functional as F
    import overlap_kernels.integrations.inductor as inductor

    dist, device = setup_rank(rank, use_gpu)
    group_name = dist.group.WORLD.group_name
    _without_compile_caches()
    route = inductor.enable()
    hidden, ffn_local, tokens = 32, 16, 8

    def funcol_block(x, w_up, w_down):  # weights [K, N]
        h = torch.relu(funcol.all_gather_tensor(x, 0, group_name) @ w_up)
        return funcol.reduce_scatter_tensor(h @ w_down, "sum", 0, group_name)

    def our_block(x, w_up, w_down):
        return F.linear_rs(torch.relu(F.linear_ag(x, w_up.t())), w_down.t())

    inputs = [
        torch.randn(tokens, hidden),
        torch.randn(hidden, ffn_local),
        torch.randn(ffn_local, hidden),
    ]
    results = []
    for fn in (our_block, torch.compile(funcol_block, fullgraph=True)):
        leaves = [t.clone().to(device).requires_grad_() for t in inputs]  # (a copy: .to(cpu) is t)
        y = fn(*leaves)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), *(t.grad for t in leaves)])
    assert route.routed == [(1, 1, 0), (1, 1, 0)], route.routed  # forward graph, backward graph
    for name, eager, compiled in zip(("y", "dx", "dw_up", "dw_down"), *results):
        # Inductor computes relu and its gradient in its own kernels (the same values:
        # relu is exact); every matmul and collective is the same op as in eager.
        assert torch.equal(eager, compiled), name
    return True


def test_enable_keeps_the_pass_before_it(monkeypatch):
    """A pass already set stays and runs first: in a list where this torch's
    Inductor takes one, else chained into one pass (torch 2.11 takes one)."""
    import types

    from overlap_kernels.integrations import inductor

    ran = []

    class Before(inductor.CustomGraphPass):
        def __call__(self, graph):
            ran.append("before")

        def uuid(self):
            return b"before"

    for lists in (True, False):
        monkeypatch.setattr(inductor, "_takes_lists", lambda lists=lists: lists)
        config = types.SimpleNamespace(post_grad_custom_post_pass=Before())
        route = inductor.enable(config)
        kept = config.post_grad_custom_post_pass
        passes = kept if lists else kept.passes
        assert isinstance(kept, list) == lists and passes[-1] is route, kept
        ran.clear()
        for each in kept if lists else (kept,):
            each(torch.fx.Graph())
        assert ran == ["before"] and route.routed == [(0, 0, 0)], (ran, route.routed)


def test_inductor_routes_collectives_to_our_ops_cpu():
    assert run_ranks(inductor_body, 2, False, timeout_s=600) == [True, True]


def dtensor_body(rank, world, use_gpu):
    """torch's own sequence-parallel TP styles on an MLP block, compiled with
    our pass enabled: the gathers and reduce-scatters DTensor emits become our
    ops (forward and backward), and output and gradients match the same
    block's plain single-process float64 reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import overlap_kernels.integrations.inductor as inductor

    dist, device = setup_rank(rank, use_gpu)
    _without_compile_caches()
    route = inductor.enable()
    hidden, ffn, tokens = 32, 16 * world, 8 * world
    torch.manual_seed(1234)  # the same model and input on every rank
    model = torch.nn.Sequential(torch.nn.Linear(hidden, ffn, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(ffn, hidden, bias=False))  # fmt: skip
    x_full = torch.randn(tokens, hidden)
    reference = [p.detach().double().clone() for p in model.parameters()]
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(model.to(device), mesh, {
        "0": ColwiseParallel(input_layouts=Shard(0)),
        "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=True),
    })  # fmt: skip
    rows = _rows(rank, tokens, world)
    x = x_full[rows].to(device).requires_grad_()
    compiled = torch.compile(lambda t: model(torch.distributed.tensor.DTensor.from_local(t, mesh, [Shard(0)])),
                             fullgraph=True)  # fmt: skip
    y = compiled(x)
    y.sum().backward()
    assert route.routed == [(1, 1, 0), (1, 1, 0)], route.routed

    # float64, one process: the whole block, then this rank's rows
    x64 = x_full.double().requires_grad_()
    w_up, w_down = (w.requires_grad_() for w in reference)
    y64 = torch.relu(x64 @ w_up.t()) @ w_down.t()
    y64.sum().backward()
    # fp32's error through two matmuls and an exact relu: at most one unit roundoff
    # per term of each dot product (hidden + ffn of them, and the sum's own),
    # over the magnitudes; dx chains the same products the other way.
    terms = (hidden + ffn + 2) * 2.0**-24
    w_up_abs, w_down_abs = w_up.detach().abs(), w_down.detach().abs()
    y_bound = terms * ((x_full.double().abs() @ w_up_abs.t()) @ w_down_abs.t())[rows]
    dx_bound = terms * ((torch.ones_like(y64) @ w_down_abs) @ w_up_abs)[rows]
    assert ((y.detach().double().cpu() - y64[rows].detach()).abs() <= y_bound).all(), "y"
    assert ((x.grad.double().cpu() - x64.grad[rows]).abs() <= dx_bound).all(), "dx"
    return True


def test_torch_tp_styles_compiled_with_the_pass_run_our_ops_cpu():
    assert run_ranks(dtensor_body, 2, False, timeout_s=600) == [True, True]


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_inductor_routes_collectives_to_our_ops_gpu(world, gpus, backend):
    assert run_on_gpus(inductor_body, world, gpus, backend, timeout_s=600) == [True] * world


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_torch_tp_styles_compiled_with_the_pass_run_our_ops_gpu(world, gpus, backend):
    assert run_on_gpus(dtensor_body, world, gpus, backend, timeout_s=600) == [True] * world


def our_styles_body(rank, world, use_gpu, output):
    """Our TP styles on an MLP block, eager: the gather runs in ag_gemm, the
    reduction in gemm_rs (output Shard(0)) or gemm_ar (Replicate), and output,
    input and weight gradients match the float64 single-process block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    import overlap_kernels.integrations.functional as functional
    from overlap_kernels.integrations.dtensor import OverlapColwiseParallel, OverlapRowwiseParallel

    dist, device = setup_rank(rank, use_gpu)
    ran = []
    for name in ("linear_ag", "linear_rs", "linear_ar"):  # which layers ran
        real = getattr(functional, name)
        setattr(
            functional,
            name,
            lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k),
        )
    hidden, ffn, tokens = 32, 16 * world, 8 * world
    torch.manual_seed(1234)  # the same model and input on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, ffn), torch.nn.ReLU(), torch.nn.Linear(ffn, hidden)
    )
    x_full = torch.randn(tokens, hidden)
    w_up, b_up, w_down, b_down = (
        p.detach().double().clone().requires_grad_() for p in model.parameters()
    )
    mesh = init_device_mesh(device.type, (world,))
    out_layout = Shard(0) if output == "shard" else Replicate()
    parallelize_module(model.to(device), mesh, {
        "0": OverlapColwiseParallel(input_layouts=Shard(0)),
        "2": OverlapRowwiseParallel(output_layouts=out_layout),
    })  # fmt: skip
    rows = _rows(rank, tokens, world)
    x = x_full[rows].to(device).requires_grad_()
    y = model(x)
    # Replicated: every rank holds the whole output and the same loss; the
    # all-reduce's backward is the identity (as in Megatron's row-parallel layer).
    y.sum().backward()
    assert ran == ["linear_ag", "linear_rs" if output == "shard" else "linear_ar"], ran

    x64 = x_full.double().requires_grad_()
    y64 = torch.relu(x64 @ w_up.t() + b_up) @ w_down.t() + b_down
    y64.sum().backward()
    # fp32 through two matmuls, two bias adds and an exact relu: one unit
    # roundoff per term of each sum (hidden + ffn + 2 of them) over the magnitudes.
    terms = (hidden + ffn + 4) * 2.0**-24
    up_abs, down_abs = w_up.detach().abs(), w_down.detach().abs()
    mine = rows if output == "shard" else slice(None)
    y_bound = terms * (
        (x_full.double().abs() @ up_abs.t() + b_up.detach().abs()) @ down_abs.t()
        + b_down.detach().abs()
    )
    dx_bound = terms * ((torch.ones_like(y64) @ down_abs) @ up_abs)
    assert ((y.detach().double().cpu() - y64[mine].detach()).abs() <= y_bound[mine]).all(), "y"
    assert ((x.grad.double().cpu() - x64.grad[rows]).abs() <= dx_bound[rows]).all(), "dx"
    # This rank's shards of the weight gradients (rows of up, columns of down).
    shard = slice(rank * ffn // world, (rank + 1) * ffn // world)
    dw_up = model[0].weight.grad.to_local().double().cpu()
    dw_down = model[2].weight.grad.to_local().double().cpu()
    dw_up_bound = terms * (torch.ones_like(y64) @ down_abs).t() @ x_full.double().abs()
    dw_down_bound = (
        terms
        * torch.ones_like(y64).t()
        @ torch.relu(x_full.double().abs() @ up_abs.t() + b_up.detach().abs())
    )
    assert ((dw_up - w_up.grad[shard]).abs() <= dw_up_bound[shard]).all(), "dw_up"
    assert ((dw_down - w_down.grad[:, shard]).abs() <= dw_down_bound[:, shard]).all(), "dw_down"
    return True


@pytest.mark.parametrize("output", ["shard", "replicate"])
def test_our_tp_styles_run_our_ops_eagerly_cpu(output):
    assert run_ranks(our_styles_body, 2, False, output) == [True, True]


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_our_tp_styles_run_our_ops_eagerly_gpu(world, gpus, backend):
    for output in ("shard", "replicate"):
        assert run_on_gpus(our_styles_body, world, gpus, backend, output) == [True] * world, output


def compiled_styles_body(rank, world, use_gpu):
    """Our TP styles under torch.compile(fullgraph=True): the same output and
    input gradient as the same module run eagerly, bit for bit (the same ops),
    and both within fp32's bounds (:func:`_mlp_bounds`) of the float64 module
    run on every rank's tokens."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap_kernels.integrations.dtensor import OverlapColwiseParallel, OverlapRowwiseParallel

    dist, device = setup_rank(rank, use_gpu)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 16 * world), torch.nn.ReLU(), torch.nn.Linear(16 * world, 32)
    )
    for p in model.parameters():  # fresh, and alike on every rank: rank 0's
        dist.broadcast(p.data, 0)
    reference = copy.deepcopy(model).double()
    parallelize_module(model.to(device), init_device_mesh(device.type, (world,)), {
        "0": OverlapColwiseParallel(input_layouts=Shard(0)),
        "2": OverlapRowwiseParallel(output_layouts=Shard(0)),
    })  # fmt: skip
    x = torch.randn(8, 32, device=device)
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.sum().backward()
        results.append((y.detach(), leaf.grad))
    (y_eager, dx_eager), (y_compiled, dx_compiled) = results
    assert torch.equal(y_eager, y_compiled) and torch.equal(dx_eager, dx_compiled)

    x_full = _gather(dist, x).double().cpu()
    g_full = torch.ones(x_full.shape[0], 32, dtype=torch.float64)  # y.sum()'s gradient
    x64 = x_full.clone().requires_grad_()
    reference(x64).backward(g_full)
    params = [(reference[i].weight.detach(), reference[i].bias.detach()) for i in (0, 2)]
    zero = [(torch.zeros_like(w), torch.zeros_like(b)) for w, b in params]
    bounds = _mlp_bounds(x_full, params, zero, g_full)
    y64 = reference(x_full).detach()
    rows = _rows(rank, x_full.shape[0], world)
    for what, (y, dx) in zip(("eager", "compiled"), results):
        _assert_within(y, y64[rows], bounds["y"][rows], f"{what} y")
        _assert_within(dx, x64.grad[rows], bounds["dx"][rows], f"{what} dx")
    return True


def test_our_tp_styles_compile_whole_cpu():
    assert run_ranks(compiled_styles_body, 2, False) == [True, True]


# ---- matmul -> all-reduce, and training against float64 -------------------------

# fp32's unit roundoff, plus float64's (the reference rounds too, far less).
_U = 2.0**-24 + 2.0**-53


def _gamma(k: int) -> float:
    """Higham's gamma_k: the relative error bound of a sum of k products in
    fp32, in any order and however split over ranks (each product and each
    addition rounds once, and no element goes through more than k roundings)."""
    return k * _U / (1 - k * _U)


def _affine_bound(a, da, w, dw, b=None, db=None):
    """How far fp32's a' @ w'.T (+ b') may be from float64's a @ w.T (+ b),
    elementwise, where |a' - a| <= da, |w' - w| <= dw and |b' - b| <= db: the
    operands' differences carried through exactly (a'w'.T - aw.T = (a' - a)w'.T
    + a(w' - w).T), plus gamma of the magnitudes (the bias one term more)."""
    a_mag, w_mag = a.abs() + da, w.abs() + dw
    carried = da @ w_mag.t() + a.abs() @ dw.t()
    magnitude, k = a_mag @ w_mag.t(), a.shape[1]
    if b is not None:
        carried, magnitude, k = carried + db, magnitude + b.abs() + db, k + 1
    return carried + _gamma(k) * magnitude


def _mlp_bounds(x, params, errors, g) -> dict:
    """Elementwise bounds on how far an fp32 MLP block (Linear, ReLU, Linear;
    any tensor-parallel split) may be from the float64 one, for the float64
    input ``x`` and output gradient ``g`` (both exact in fp32 too): output,
    input gradient and every parameter's gradient, keyed as named_parameters
    names them. ``params`` are the float64 block's (weight, bias) pairs, bias
    None where absent; ``errors`` how far the fp32 parameters may be from them.

    Each product by :func:`_affine_bound`; ReLU is 1-Lipschitz, so the hidden
    activation carries the pre-activation's bound. Its gradient mask is the one
    place a tiny difference is not carried smoothly: where the float64
    pre-activation lies within its bound of 0 the fp32 mask may differ, and
    there the gradient may be off by its whole magnitude."""
    (w1, b1), (w2, b2) = params
    (e1, eb1), (e2, eb2) = errors
    zero_x, zero_g = torch.zeros_like(x), torch.zeros_like(g)
    pre = x @ w1.t() + (0 if b1 is None else b1)
    d_pre = _affine_bound(x, zero_x, w1, e1, b1, eb1)
    h, d_h = torch.relu(pre), d_pre
    d_y = _affine_bound(h, d_h, w2, e2, b2, eb2)
    g_h = g @ w2
    d_g_h = _affine_bound(g, zero_g, w2.t(), e2.t())
    unsure = pre.abs() <= d_pre
    d_pre_grad = d_g_h + unsure * g_h.abs()
    pre_grad = g_h * (pre > 0)
    bounds = {
        "y": d_y,
        "dx": _affine_bound(pre_grad, d_pre_grad, w1.t(), e1.t()),
        "0.weight": _affine_bound(pre_grad.t(), d_pre_grad.t(), x.t(), zero_x.t()),
        "2.weight": _affine_bound(g.t(), zero_g.t(), h.t(), d_h.t()),
    }
    tokens = x.shape[0]
    if b1 is not None:
        bounds["0.bias"] = d_pre_grad.sum(0) + _gamma(tokens) * (pre_grad.abs() + d_pre_grad).sum(0)
    if b2 is not None:
        bounds["2.bias"] = _gamma(tokens) * g.abs().sum(0)
    return bounds


def _assert_within(out, reference, bound, what: str) -> None:
    diff = (out.detach().double().cpu() - reference.detach()).abs()
    ok = diff <= bound  # (False where out is NaN)
    if not bool(ok.all()):
        i = int((~ok).flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: element {i} is off by {diff.flatten()[i].item():.3g}, "
            f"at most {bound.flatten()[i].item():.3g} allowed"
        )


def _route_and_watch():
    """Our pass enabled (caches off), then a pass after it that records every
    post-grad graph's ops: (the route, a list of Counters of op targets)."""
    import collections

    from torch._inductor.custom_graph_pass import CustomGraphPass

    import overlap_kernels.integrations.inductor as inductor

    class GraphOps(CustomGraphPass):
        def __init__(self):
            self.graphs = []

        def __call__(self, graph):
            targets = (n.target for n in graph.nodes if n.op == "call_function")
            self.graphs.append(collections.Counter(targets))

        def uuid(self):
            return None  # (nothing to cache)

    _without_compile_caches()
    route, watch = inductor.enable(), GraphOps()
    inductor.add_post_grad_pass(watch)  # (after ours: it sees the graphs as routed)
    return route, watch.graphs


def _collectives(ops) -> dict:
    """torch's collectives in a graph's op counts (ours are not counted)."""
    c10d = torch.ops._c10d_functional
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    return {
        name: ops[getattr(c10d, name).default] for name in names if ops[getattr(c10d, name).default]
    }


def _counts(graphs, op) -> list[int]:
    return [ops[op] for ops in graphs]


def funcol_all_reduce_body(rank, world, use_gpu):
    """A tensor-parallel MLP block without sequence parallelism, written with
    torch's functional all-reduce as Megatron's layers are: the row-parallel
    output all-reduced in forward, the replicated input's gradient (a partial
    sum) all-reduced in backward. Compiled by Inductor with our pass, each
    all-reduce and the matmul feeding it become one gemm_ar, forward and
    backward; compiled and eager, output and gradients lie within fp32's
    bounds of the float64 block (so within twice that of each other)."""
    import torch.distributed._functional_collectives as funcol

    dist, device = setup_rank(rank, use_gpu)
    route, graphs = _route_and_watch()
    group_name = dist.group.WORLD.group_name

    class AllReduce(torch.autograd.Function):  # forward: the sum; backward: identity
        @staticmethod
        def forward(ctx, t):
            return funcol.wait_tensor(funcol.all_reduce(t, "sum", group_name))

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Replicated(torch.autograd.Function):  # forward: identity; backward: the sum
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", group_name))

    def block(x, w_up, w_down):  # nn.Linear weights: [F_local, H], [H, F_local]
        h = torch.relu(Replicated.apply(x) @ w_up.t())
        return AllReduce.apply(h @ w_down.t())

    hidden, ffn, tokens = 32, 16 * world, 12
    torch.manual_seed(1234)  # the same weights, input and output gradient on every rank
    w_up, w_down = torch.randn(ffn, hidden) / hidden**0.5, torch.randn(hidden, ffn) / ffn**0.5
    x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    shard = slice(rank * ffn // world, (rank + 1) * ffn // world)
    params = [(w_up.double(), None), (w_down.double(), None)]
    zero = [(torch.zeros_like(w_up.double()), None), (torch.zeros_like(w_down.double()), None)]
    bounds = _mlp_bounds(x.double(), params, zero, g.double())
    x64 = x.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in (w_up, w_down)]
    y64 = torch.relu(x64 @ w64[0].t()) @ w64[1].t()
    y64.backward(g.double())

    for name, fn in (("eager", block), ("compiled", torch.compile(block, fullgraph=True))):
        leaves = [t.clone().to(device).requires_grad_() for t in (x, w_up[shard], w_down[:, shard])]
        y = fn(*leaves)
        y.backward(g.to(device))
        _assert_within(y, y64, bounds["y"], f"{name} y")
        _assert_within(leaves[0].grad, x64.grad, bounds["dx"], f"{name} dx")
        _assert_within(
            leaves[1].grad, w64[0].grad[shard], bounds["0.weight"][shard], f"{name} dw_up"
        )
        _assert_within(leaves[2].grad, w64[1].grad[:, shard], bounds["2.weight"][:, shard], f"{name} dw_down")  # fmt: skip
    assert route.routed == [(0, 0, 1), (0, 0, 1)], route.routed  # forward graph, backward graph
    assert _counts(graphs, torch.ops.overlap_kernels.gemm_ar.default) == [1, 1], graphs
    assert [_collectives(ops) for ops in graphs] == [{}, {}], graphs

    # A weight the kernels cannot read as it stands (a column slice: neither
    # row-major nor a row-major matrix transposed) keeps torch's all-reduce.
    h = torch.randn(tokens, ffn, device=device)
    w_cols = torch.randn(hidden, 2 * ffn, device=device)[:, :ffn]
    y = torch.compile(lambda a, w: AllReduce.apply(a @ w.t()), fullgraph=True)(h, w_cols)
    assert route.routed[2:] == [(0, 0, 0)] and _collectives(graphs[2]) == {"all_reduce": 1}
    check_sum(dist, y, h, w_cols.t(), what="an all-reduce left to torch")
    return True


def test_inductor_routes_matmul_all_reduce_to_gemm_ar_cpu():
    assert run_ranks(funcol_all_reduce_body, 2, False, timeout_s=600) == [True, True]


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_inductor_routes_matmul_all_reduce_to_gemm_ar_gpu(world, gpus, backend):
    assert (
        run_on_gpus(funcol_all_reduce_body, world, gpus, backend, timeout_s=600) == [True] * world
    )


def training_body(rank, world, use_gpu, styles, compiler, layout, bias):
    """Issue 25's training test. A two-layer MLP block (Linear up, ReLU, Linear
    down) parallelized with ``styles`` ("ours": OverlapColwiseParallel /
    OverlapRowwiseParallel; "torch": torch's), with sequence parallelism
    (``layout`` "sequence": tokens sharded in and out) or without ("replicate"),
    run eagerly or compiled (``compiler`` "inductor", our pass enabled), with
    biases or without, and a single-process float64 copy of it: three steps of
    SGD on both, each checking output, input gradient and every parameter's
    gradient, then the parameters after the step, within fp32's bounds of the
    float64 model (:func:`_mlp_bounds`, carried from step to step). Compiled,
    the graphs (forward and backward) run our ops and none of torch's
    collectives (so torch's styles go without biases: a linear with its bias is
    an ``addmm``, which the pass leaves alone)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from overlap_kernels.integrations.dtensor import OverlapColwiseParallel, OverlapRowwiseParallel

    dist, device = setup_rank(rank, use_gpu)
    if compiler == "inductor":
        route, graphs = _route_and_watch()
    hidden, ffn, tokens = 32, 16 * world, 8 * world
    lr = 2.0**-5  # exact in fp32: both models step by the same lr
    torch.manual_seed(1234)  # the same model and data on every rank
    model = torch.nn.Sequential(torch.nn.Linear(hidden, ffn, bias=bias), torch.nn.ReLU(),
                                torch.nn.Linear(ffn, hidden, bias=bias))  # fmt: skip
    reference = copy.deepcopy(model).double()
    batches = [(torch.randn(tokens, hidden), torch.randn(tokens, hidden)) for _ in range(3)]
    colwise, rowwise = {"ours": (OverlapColwiseParallel, OverlapRowwiseParallel),
                        "torch": (ColwiseParallel, RowwiseParallel)}[styles]  # fmt: skip
    sequence = layout == "sequence"
    parallelize_module(model.to(device), init_device_mesh(device.type, (world,)), {
        "0": colwise(input_layouts=Shard(0)) if sequence else colwise(),
        "2": rowwise(output_layouts=Shard(0)) if sequence else rowwise(output_layouts=Replicate()),
    })  # fmt: skip
    run = torch.compile(model, fullgraph=True) if compiler == "inductor" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)

    rows = _rows(rank, tokens, world) if sequence else slice(None)  # this rank's tokens
    shard = slice(rank * ffn // world, (rank + 1) * ffn // world)  # and its hidden features
    mine = {
        "0.weight": (shard,),
        "0.bias": (shard,),
        "2.weight": (slice(None), shard),
        "2.bias": (),
    }
    names = [name for name, _ in reference.named_parameters()]
    # how far each fp32 parameter may be from the float64 one, elementwise
    errors = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}

    def local(p):
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    def pairs(d):  # [(weight, bias)] of each linear
        return [(d[f"{i}.weight"], d.get(f"{i}.bias")) for i in (0, 2)]

    for step, (x_full, g_full) in enumerate(batches):
        ours = dict(model.named_parameters())
        theirs = dict(reference.named_parameters())
        x = x_full[rows].to(device).requires_grad_()
        y = run(x)
        y.backward(g_full[rows].to(device))
        x64 = x_full.double().requires_grad_()
        y64 = reference(x64)
        y64.backward(g_full.double())

        params = [(w.detach(), None if b is None else b.detach()) for w, b in pairs(theirs)]
        bounds = _mlp_bounds(x_full.double(), params, pairs(errors), g_full.double())
        _assert_within(y, y64[rows], bounds["y"][rows], f"step {step}: y")
        _assert_within(x.grad, x64.grad[rows], bounds["dx"][rows], f"step {step}: dx")
        for name in names:
            _assert_within(local(ours[name].grad), theirs[name].grad[mine[name]],
                           bounds[name][mine[name]], f"step {step}: d{name}")  # fmt: skip

        # SGD: p - lr * dp. Beyond the differences carried (the parameter's and
        # lr times its gradient's), fp32 rounds the product and the difference:
        # at most u (|p| + 3 lr |dp|) with the magnitudes of the fp32 values.
        for name in names:
            p, dp, e = theirs[name].detach(), theirs[name].grad, errors[name]
            d_dp = bounds[name]
            errors[name] = e + lr * d_dp + _U * (p.abs() + e + 3 * lr * (dp.abs() + d_dp))
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        for name in names:
            _assert_within(local(ours[name]), theirs[name][mine[name]],
                           errors[name][mine[name]], f"step {step}: {name} after the step")  # fmt: skip

    if compiler == "inductor":
        assert len(graphs) == 2, f"compiled {len(graphs)} graphs, expected a forward and a backward"
        assert [_collectives(ops) for ops in graphs] == [{}, {}], graphs
        ops = torch.ops.overlap_kernels
        wanted = (
            {ops.ag_gemm.default: 1, ops.gemm_rs.default: 1}
            if sequence
            else {ops.gemm_ar.default: 1}
        )
        for graph in graphs:
            assert {op: graph[op] for op in wanted} == wanted, graph
        routed = (1, 1, 0) if sequence else (0, 0, 1)
        assert route.routed == [routed if styles == "torch" else (0, 0, 0)] * 2, route.routed
    return True


_TRAINING_CASES = [  # (styles, compiler, layout, bias)
    ("ours", "eager", "sequence", False),
    ("ours", "eager", "sequence", True),  # the bias gradient: a sum over every rank's rows
    ("ours", "eager", "replicate", True),
    ("ours", "inductor", "sequence", False),
    ("torch", "inductor", "sequence", False),
    ("torch", "inductor", "replicate", False),
]


@pytest.mark.parametrize(("styles", "compiler", "layout", "bias"), _TRAINING_CASES)
def test_mlp_block_trains_like_float64_cpu(styles, compiler, layout, bias):
    assert (
        run_ranks(training_body, 2, False, styles, compiler, layout, bias, timeout_s=600)
        == [True] * 2
    )


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_mlp_block_trains_like_float64_gpu(world, gpus, backend):
    for case in _TRAINING_CASES:
        assert (
            run_on_gpus(training_body, world, gpus, backend, *case, timeout_s=600) == [True] * world
        ), case
