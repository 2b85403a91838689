"""The custom ops (torch.ops.overlap_kernels), their gradients and the
functional TP layers: schemas and fakes (opcheck), forward and backward
against float64 references on 2 and 4 CPU ranks, and torch.compile."""

from __future__ import annotations

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank
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
    assert run_ranks(opcheck_body, world, False) == [10] * world


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


@pytest.mark.parametrize("world", [2, 4])
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
    their paths; CUDA's measure and may switch between calls)."""
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
        leaves = [t.to(device).requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), *(t.grad for t in leaves)])
    assert route.routed == [(1, 1), (1, 1)], route.routed  # forward graph, backward graph
    for name, eager, compiled in zip(("y", "dx", "dw_up", "dw_down"), *results):
        # Inductor computes relu and its gradient in its own kernels (the same values:
        # relu is exact); every matmul and collective is the same op as in eager.
        assert torch.equal(eager, compiled), name
    return True


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
    assert route.routed == [(1, 1), (1, 1)], route.routed

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
    input gradient as the same module run eagerly, bit for bit (the same ops)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap_kernels.integrations.dtensor import OverlapColwiseParallel, OverlapRowwiseParallel

    dist, device = setup_rank(rank, use_gpu)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 16 * world), torch.nn.ReLU(), torch.nn.Linear(16 * world, 32)
    )
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
    return True


def test_our_tp_styles_compile_whole_cpu():
    assert run_ranks(compiled_styles_body, 2, False) == [True, True]
