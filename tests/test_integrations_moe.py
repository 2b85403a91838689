"""The MoE ops in models: ``torch.ops.overlap_kernels.moe_mlp`` (schema, fake,
torch.compile, its refusal to record gradients); the custom ops
``moe_dispatch`` / ``moe_combine`` / ``moe_combine_backward`` (opcheck, the
library's results); and the differentiable ``functional.moe_dispatch`` /
``moe_combine`` that run them (forward and gradients of a dispatch -> expert
-> combine chain against a float64 single-process reference built from every
rank's inputs, eagerly and under torch.compile(fullgraph=True)), on CPU ranks
and, behind the ``gpu`` marker, on GPUs."""

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


def _layer_problem(dist, out, x, ids, weights, w_gate_up, w_down, residual: bool) -> str | None:
    """Collective: ``out`` of this rank's tokens against the float64 layer built
    from every rank's experts (reference.moe_mlp_reference), ``residual``: of
    x + moe_mlp(rms_norm(x)). Judged as the tests judge an MoE layer
    (reference.judge_moe): its relative error at most twice that of the plain
    fp32 algorithm (each GEMM, the activation and each expert's output rounded
    where every implementation rounds) plus fp32's floor; per element the
    activation makes any bound too loose to mean anything."""
    from overlap_kernels.reference import judge_moe, moe_mlp_reference

    world = dist.get_world_size()
    experts = [None] * world
    dist.all_gather_object(experts, (w_gate_up.cpu(), w_down.cpu()))
    w_gate_ups, w_downs = [e[0] for e in experts], [e[1] for e in experts]
    x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
    if not residual:
        reference, plain = moe_mlp_reference(x, ids, weights, w_gate_ups, w_downs)
        return judge_moe(out.detach().cpu(), reference, plain).problem
    eps = torch.finfo(x.dtype).eps  # the layer's (rms_norm's default for its dtype)
    normed64 = torch.nn.functional.rms_norm(x.double(), (x.shape[1],), eps=eps)
    normed = torch.nn.functional.rms_norm(x, (x.shape[1],))  # what the layer's op gets
    reference = x.double() + moe_mlp_reference(normed64, ids, weights, w_gate_ups, w_downs)[0]
    plain = x + moe_mlp_reference(normed, ids, weights, w_gate_ups, w_downs)[1]
    return judge_moe(out.detach().cpu(), reference, plain).problem


def moe_mlp_op_body(rank, world, use_gpu):
    """opcheck (schema, fake); the op's result is the Python op's, bit for bit,
    with the keyword knobs passed through, and both are the float64 layer's
    (:func:`_layer_problem`); operands that require grad are refused before
    anything is sent; torch.compile(fullgraph, aot_eager) of a residual layer
    around the op gives the eager result, which is the float64 layer's; a layer with the
    differentiable dispatch and combine compiled without fullgraph (graph
    breaks) gives eager's output and gradients (fullgraph: compiled_chain_body)."""
    from torch.library import opcheck

    import overlap_kernels as ok
    import overlap_kernels.integrations.autograd  # noqa: F401  (moe_mlp's autograd kernel)
    from overlap_kernels.integrations.torch_ops import name_of

    dist, device = setup_rank(rank, use_gpu)
    op, name = torch.ops.overlap_kernels.moe_mlp, name_of(None)
    checks = 0
    # The interpreter's template resolves "auto" to the fused path: both paths run, and
    # the graph mode (every rank passes 6 tokens).
    for kwargs in ({}, {"path": "unfused", "max_recv_tokens": 64}, {"max_tokens_per_rank": 6}):
        args, num_experts = _mlp_inputs(world, device)
        opcheck(
            op.default,
            (*args, name, num_experts),
            kwargs,
            test_utils=("test_schema", "test_faketensor"),
        )
        knobs = {k: v for k, v in kwargs.items() if k != "max_tokens_per_rank"}
        config = {"max_recv_tokens": None, **knobs} if knobs else None
        expected = ok.moe_mlp(*args, None, num_experts=num_experts, config=config,
                              max_tokens_per_rank=kwargs.get("max_tokens_per_rank"))  # fmt: skip
        assert torch.equal(op(*args, name, num_experts, **kwargs), expected), kwargs
        problem = _layer_problem(dist, expected, *args, residual=False)
        assert problem is None, f"moe_mlp {kwargs} against float64: {problem}"
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
    for tokens in (6, 5):  # another T: recompiled or dynamic, same answer
        args, _ = _mlp_inputs(world, device, tokens=tokens)
        out = compiled(*args)
        assert torch.equal(out, layer(*args))
        problem = _layer_problem(dist, out, *args, residual=True)
        assert problem is None, f"compiled layer, T = {tokens}, against float64: {problem}"
    checks += 1

    # The differentiable dispatch and combine in a layer compiled without fullgraph:
    # the graph breaks at the dispatch op (its row count is data-dependent) and at
    # handle.expert_counts (host ints); the ops run eagerly there, untraced.
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
    assert run_ranks(moe_mlp_op_body, world, False) == [8] * world


@gpu_ranks(worlds=(1, 2), backends=("torch",))
def test_moe_mlp_op_gpu(world, gpus, backend):
    assert run_on_gpus(moe_mlp_op_body, world, gpus, backend) == [8] * world


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


def _check_chain(dist, rank, inputs, results, what: str) -> None:
    """The chain's results {out, dx, dw, dW} on this rank against _chain64 of
    every rank's inputs (x, ids, w, experts, output gradient).

    Tolerance: out, dx, dw and dW are sums of products of the inputs (the
    chain is linear in each), computed in fp32 through at most
    D = H + N + P + k + W + 4 roundings (P: all routed pairs, the longest sum
    being an expert's weight gradient over its rows), so each element is off
    by at most gamma_D ~ D * 2^-24 times the sum of its terms' magnitudes,
    which is the same chain run on |inputs| (_chain64 of the absolute values).
    Twice that bound allows any summation order. A wrong, missing or extra
    term is off by a whole term, at least 1/P of that sum; unused slots'
    weight gradients must be exactly 0."""
    world = dist.get_world_size()
    parts = [None] * world
    dist.all_gather_object(parts, tuple(t.detach().cpu() for t in inputs))
    xs, idss, ws, ex, gs = (list(c) for c in zip(*parts))
    ref = _chain64(xs, idss, ws, ex, gs)
    magnitude = _chain64([a.abs() for a in xs], idss, [a.abs() for a in ws],
                         [a.abs() for a in ex], [a.abs() for a in gs])  # fmt: skip
    (tokens, hidden), (e_local, _, n), k = xs[rank].shape, ex[rank].shape, idss[rank].shape[1]
    pairs = sum(int((i >= 0).sum()) for i in idss)
    bound_scale = 2 * (hidden + n + pairs + k + world + 4) * _EPS32
    start = sum(a.shape[0] for a in xs[:rank])
    rows, experts_mine = slice(start, start + tokens), slice(rank * e_local, (rank + 1) * e_local)
    for i, name in enumerate(("out", "dx", "dw", "dW")):
        got, sel = results[name], experts_mine if name == "dW" else rows
        want, allowed = ref[i][sel], bound_scale * magnitude[i][sel]
        assert got is not None and got.shape == want.shape, f"{name} ({what}): shape"
        got = got.detach().double().cpu()
        excess = (got - want).abs() - allowed
        assert not got.isnan().any() and excess.max() <= 0, (
            f"{name} ({what}) off by {(got - want).abs().max():.3g}; "
            f"bound at the worst element {allowed.reshape(-1)[excess.argmax()]:.3g}"
        )
    unused = results["dw"].cpu()[idss[rank] < 0]
    assert (unused == 0).all(), f"unused slots' weight gradients ({what})"


def _chain_inputs(device, tokens: int, num_experts: int, hidden=16, n=8, k=3, e_local=2):
    ids, w = _routing(tokens, k, num_experts, device)
    x = torch.randn(tokens, hidden, device=device)
    experts = torch.randn(e_local, hidden, n, device=device) / math.sqrt(hidden)
    return x, ids, w, experts


def _run_chain(fn, x, ids, w, experts, expanded: bool):
    """fn(x, ids, w, experts) -> out, then its backward (from out.sum(): an
    expanded gradient, or a random one): (inputs with that gradient, results)."""
    leaves = [t.clone().requires_grad_() for t in (x, w, experts)]
    out = fn(leaves[0], ids, leaves[1], leaves[2])
    g = torch.ones_like(out) if expanded else torch.randn_like(out)
    out.sum().backward() if expanded else out.backward(g)
    grads = dict(zip(("dx", "dw", "dW"), (t.grad for t in leaves)))
    return (x, ids, w, experts, g), {"out": out.detach(), **grads}


def chain_body(rank, world, use_gpu):
    """recv_x, handle = moe_dispatch(x, ...); y = recv_x @ W[e] per local
    expert; out = moe_combine(y, handle): out and the gradients of x,
    topk_weights and W against float64 (_check_chain), for a random output
    gradient and for out.sum() (an expanded one); recv_x and out are those of
    the library's moe_dispatch / moe_combine, bit for bit."""
    import overlap_kernels as ok
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    tokens, e_local = 5 + rank, 2
    num_experts = e_local * world
    seen = {}

    def chain(x, ids, w, experts):  # the experts take host ints from the handle
        recv_x, handle = F.moe_dispatch(
            x, ids, w, num_experts=num_experts, config={"timeout_s": 20.0}
        )
        ends = torch.tensor([0, *handle.expert_counts]).cumsum(0).tolist()
        y = torch.cat([recv_x[ends[e] : ends[e + 1]] @ experts[e] for e in range(e_local)])
        seen.update(recv_x=recv_x.detach(), y=y.detach(), counts=handle.expert_counts)
        return F.moe_combine(y, handle)

    checked = 0
    for expanded in (False, True):
        x, ids, w, experts = _chain_inputs(device, tokens, num_experts)
        inputs, results = _run_chain(chain, x, ids, w, experts, expanded)
        _check_chain(dist, rank, inputs, results, f"expanded={expanded}")
        recv_plain, plain = ok.moe_dispatch(x, ids, w, num_experts=num_experts)
        assert torch.equal(seen["recv_x"], recv_plain) and seen["counts"] == plain.expert_counts
        assert torch.equal(results["out"], ok.moe_combine(seen["y"], plain)), "out vs moe_combine"
        checked += 1

    # A plain MoeHandle (the op's) cannot differentiate: refused before anything is sent.
    x = torch.randn(tokens, 16, device=device)
    ids, w = _routing(tokens, 3, num_experts, device)
    recv_x, plain = ok.moe_dispatch(x, ids, w, num_experts=num_experts)
    with pytest.raises(
        ok.OverlapInputError, match="moe_combine: y requires grad.*functional.moe_dispatch"
    ):
        F.moe_combine(recv_x.clone().requires_grad_(), plain)
    assert torch.equal(
        F.moe_combine(recv_x, plain), ok.moe_combine(recv_x, plain)
    )  # no grad: allowed
    return checked + 1


@pytest.mark.parametrize("world", [2, 3])
def test_moe_dispatch_combine_gradients_cpu(world):
    assert run_ranks(chain_body, world, False) == [3] * world


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_moe_dispatch_combine_gradients_gpu(world, gpus, backend):
    assert run_on_gpus(chain_body, world, gpus, backend) == [3] * world


# ---- moe_dispatch / moe_combine as custom ops ------------------------------------------


def moe_ops_body(rank, world, use_gpu):
    """opcheck of the dispatch, the combine and the combine's backward (with
    and without y); their results are the library's moe_dispatch /
    moe_combine, bit for bit, with the keyword knobs passed through; where
    topk_weights need no grad, x's gradient is the same."""
    from torch.library import opcheck

    import overlap_kernels as ok
    import overlap_kernels.integrations.functional as F  # (and the ops' gradients)
    from overlap_kernels.integrations.torch_ops import name_of

    dist, device = setup_rank(rank, use_gpu)
    ops, name = torch.ops.overlap_kernels, name_of(None)
    num_experts = 4 * world  # (k = 3 distinct experts per token, also on one rank)
    checks = 0
    for kwargs in ({}, {"max_recv_tokens": 64, "timeout_s": 20.0}):
        x, ids, w, _ = _chain_inputs(device, 4 + rank, num_experts)
        # Not test_aot_dispatch_static: without a ShapeEnv recv_x's unbacked row count cannot be made.
        opcheck(ops.moe_dispatch.default, (x.clone().requires_grad_(), ids, w, name, num_experts), kwargs,
                test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                            "test_aot_dispatch_dynamic"))  # fmt: skip
        recv_x, recv_weights, counts, *route = ops.moe_dispatch(
            x, ids, w, name, num_experts, **kwargs
        )
        recv_plain, plain = ok.moe_dispatch(
            x, ids, w, num_experts=num_experts, config=kwargs or None
        )
        assert torch.equal(recv_x, recv_plain) and torch.equal(recv_weights, plain.recv_weights)
        assert tuple(counts.tolist()) == plain.expert_counts and counts.device.type == "cpu"

        timeout = {k: v for k, v in kwargs.items() if k == "timeout_s"}
        y = torch.randn(recv_x.shape[0], 8, device=device)
        args = (recv_weights, w, ids, *route, name)
        opcheck(ops.moe_combine.default, (y.clone().requires_grad_(), *args[:1],
                w.clone().requires_grad_(), *args[2:]), timeout)  # fmt: skip
        assert torch.equal(ops.moe_combine(y, *args, **timeout), ok.moe_combine(y, plain))
        g = torch.randn(x.shape[0], 8, device=device)
        # (Without y it can give dy only: what the autograd asks where topk_weights needs no grad.)
        y_dw = (y, {}) if not kwargs else (None, {"dw": False})
        opcheck(ops.moe_combine_backward.default, (g, y_dw[0], *args), {**y_dw[1], **timeout})
        checks += 1

    # topk_weights without grad: the combine keeps no y and asks for dy alone; dx is the same.
    dxs = []
    for weights_grad in (True, False):
        leaves = (x.clone().requires_grad_(), w.clone().requires_grad_(weights_grad))
        recv_x, handle = F.moe_dispatch(leaves[0], ids, leaves[1], num_experts=num_experts)
        F.moe_combine(2 * recv_x, handle).sum().backward()
        dxs.append(leaves[0].grad)
    assert torch.equal(*dxs) and dxs[0].abs().sum() > 0
    return checks + 1


@pytest.mark.parametrize("world", [1, 2])
def test_moe_dispatch_combine_ops_cpu(world):
    assert run_ranks(moe_ops_body, world, False) == [3] * world


@gpu_ranks(worlds=(1, 2), backends=("torch",))
def test_moe_dispatch_combine_ops_gpu(world, gpus, backend):
    assert run_on_gpus(moe_ops_body, world, gpus, backend) == [3] * world


def compiled_chain_body(rank, world, use_gpu, backend, experts_by):
    """The chain dispatch -> expert matmuls -> combine under
    torch.compile(fullgraph=True): no graph break (recv_x's row count is an
    unbacked size), output and gradients against float64 (_check_chain), and
    with ``aot_eager`` those of the same function run eagerly, bit for bit
    (Inductor generates its own kernels around the ops: rounding differs);
    then another T, without grad. ``experts_by``: "rows" takes each row's
    expert from the handle's counts tensor, "slices" slices recv_x at host
    ints (unbacked under fullgraph; Inductor's lowering of the slices'
    gradient wants them bounded with torch._check, so aot_eager only)."""
    import overlap_kernels.integrations.functional as F

    dist, device = setup_rank(rank, use_gpu)
    tokens, e_local = 5 + rank, 2
    num_experts = e_local * world

    def by_rows(x, ids, w, experts):
        recv_x, handle = F.moe_dispatch(x, ids, w, num_experts=num_experts)
        counts = handle.expert_counts_tensor.to(x.device)
        row_expert = torch.repeat_interleave(
            torch.arange(e_local, device=x.device), counts, output_size=recv_x.shape[0]
        )
        return F.moe_combine(torch.bmm(recv_x[:, None], experts[row_expert])[:, 0], handle)

    def by_slices(x, ids, w, experts):
        recv_x, handle = F.moe_dispatch(x, ids, w, num_experts=num_experts)
        ends = torch.tensor([0, *handle.expert_counts]).cumsum(0).tolist()
        y = torch.cat([recv_x[ends[e] : ends[e + 1]] @ experts[e] for e in range(e_local)])
        return F.moe_combine(y, handle)

    grads = ("dx", "dw", "dW")
    chain = {"rows": by_rows, "slices": by_slices}[experts_by]
    compiled = torch.compile(chain, fullgraph=True, backend=backend)
    for expanded in (False, True):
        x, ids, w, experts = _chain_inputs(device, tokens, num_experts)
        inputs, results = _run_chain(compiled, x, ids, w, experts, expanded)
        _check_chain(dist, rank, inputs, results, f"expanded={expanded}")
        if backend == "aot_eager":
            leaves = [t.clone().requires_grad_() for t in (x, w, experts)]
            out = chain(leaves[0], ids, leaves[1], leaves[2])
            out.backward(inputs[-1])
            eager = {"out": out.detach(), **dict(zip(grads, (t.grad for t in leaves)))}
            for key, value in eager.items():
                assert torch.equal(results[key], value), f"{key} (expanded={expanded})"
    if backend == "aot_eager":
        x, ids, w, experts = _chain_inputs(device, tokens + 2, num_experts)
        with torch.no_grad():
            assert torch.equal(compiled(x, ids, w, experts), chain(x, ids, w, experts))
    return True


@pytest.mark.parametrize(
    ("world", "backend", "experts_by"),
    [(2, "aot_eager", "rows"), (2, "aot_eager", "slices"), (3, "aot_eager", "rows"),
     (2, "inductor", "rows")],
)  # fmt: skip
def test_moe_dispatch_combine_compiled_fullgraph_cpu(world, backend, experts_by):
    assert run_ranks(compiled_chain_body, world, False, backend, experts_by) == [True] * world


@gpu_ranks(worlds=(2,), backends=("torch",))
def test_moe_dispatch_combine_compiled_fullgraph_gpu(world, gpus, backend):
    results = run_on_gpus(compiled_chain_body, world, gpus, backend, "aot_eager", "rows")
    assert results == [True] * world
