"""The MoE graph mode (ops/moe_graph.py): moe_dispatch_graph and moe_combine_graph,
eager and replayed, on 1-4 rank processes: CPU (gloo, Triton's interpreter) and,
behind the ``gpu`` marker, CUDA GPUs.

Judged as tests/test_moe.py judges moe_dispatch and moe_combine (its helpers):
the rows before ``expert_ends[-1]`` bit for bit against the contract's routing,
every combine element by element against float64 within the contract's bound,
and, here, every combine's bits against moe_combine's on the same rows (the
contract's sums in its order). Every routing case of test_moe (empty experts,
all tokens to one expert, -1 slots, duplicates, top-k up to 8, ranks with no
token), eager and then replayed with fresh tokens and routings. On the CPU a
replay is what a captured graph runs (the plans' ``replay=True``: Triton's
interpreter has no graphs); on GPUs one graph of dispatch -> torch._grouped_mm
-> combine is captured and replayed 100 times.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, setup_rank
from test_moe import (
    BF16,
    CASES,
    _bits,
    _ids,
    _weight,
    check_case,
    combine_problem,
    make_inputs,
    runs_case_here,
)

from overlap_kernels.launch import run_ranks
from overlap_kernels.limits import REPLAY_EPOCH_SLOT
from overlap_kernels.ops.moe import _config as moe_config
from overlap_kernels.ops.moe_graph import combine_plan, dispatch_plan
from overlap_kernels.reference import poisoned

REPLAYS = 1  # per routing case on the CPU, with fresh tokens and routing: the eager call and it use both buffer halves
GPU_REPLAYS = 100


def _view(recv_x, handle):
    """(recv_x rows, a moe_dispatch-like handle) of the rows the dispatch filled, for
    test_moe's checks; also that the counts and their ends agree."""
    ends = handle.expert_ends.cpu().long()
    counts = handle.expert_counts.cpu().long()
    assert torch.equal(ends, counts.cumsum(0)), f"expert_ends {ends} are not the counts' {counts}"
    n = int(ends[-1]) if len(ends) else 0
    like = SimpleNamespace(
        expert_counts=tuple(int(c) for c in counts), num_tokens=handle.num_tokens,
        recv_src_rank=handle.recv_src_rank[:n].long(), recv_src_token=handle.recv_src_token[:n].long(),
        recv_weights=handle.recv_weights[:n],
    )  # fmt: skip
    return recv_x[:n], like, n


def _graph_outputs(ok, plans, inp, outs_of_rows, max_tokens, replay: bool):
    """Dispatch (its plan, eager or replayed), the round trip of recv_x, and the
    combine of y (``outs_of_rows``: y's rows from recv_x's), each combine into a
    poisoned out; and y with its rows past the dispatch's NaN (never read)."""
    kw = {"num_experts": inp.num_experts, "max_tokens_per_rank": max_tokens, "config": {"timeout_s": 20.0}}  # fmt: skip
    if replay:
        recv_x, handle = plans["dispatch"](inp.x, inp.ids, inp.w, plans["capacity"], replay=True)
    else:
        recv_x, handle = ok.moe_dispatch_graph(inp.x, inp.ids, inp.w, **kw)
    rows, like, n = _view(recv_x, handle)
    y = torch.full((recv_x.shape[0], inp.wf.shape[2]), math.nan, dtype=inp.ydtype, device=recv_x.device)  # fmt: skip
    y[:n] = outs_of_rows(rows, like.expert_counts)
    outs = {"recv_x": rows, "handle": like, "y": y[:n]}
    for name, rows_in in (("back", recv_x), ("out", y)):
        out = poisoned((inp.x.shape[0], rows_in.shape[1]), rows_in.dtype, rows_in.device)
        if replay:
            got = plans[name](rows_in, handle, out, replay=True)
        else:
            got = ok.moe_combine_graph(rows_in, handle, out=out)
            plans[name] = combine_plan(rows_in, handle)
        assert got is out, "moe_combine_graph did not return out"
        outs[name] = out
    if not replay:
        plans["dispatch"], plans["capacity"] = handle._plan, handle.capacity
    return outs


def _expert_outputs(inp):
    """y of test_moe's combine case: each row times its expert's wf (fp32), in ydtype."""

    def rows(recv_x, counts):
        out, start = [], 0
        for e, c in enumerate(counts):
            out.append(recv_x[start : start + c].float() @ inp.wf[e].float())
            start += c
        return torch.cat(out).to(inp.ydtype) if out else recv_x.new_zeros(0, inp.wf.shape[2])

    return rows


def _same_bits_as_moe_combine(ok, inp, outs, what: str) -> None:
    """moe_dispatch + moe_combine on the same inputs and y give the graph mode's bits."""
    recv_x, handle = ok.moe_dispatch(inp.x, inp.ids, inp.w, num_experts=inp.num_experts)
    assert torch.equal(_bits(recv_x.cpu()), _bits(outs["recv_x"].cpu())), f"{what}: recv_x"
    for name, y in (("back", recv_x), ("out", outs["y"])):
        want = ok.moe_combine(y, handle)
        got = outs[name]
        assert torch.equal(_bits(got.cpu()), _bits(want.cpu())), f"{what}: {name} is not moe_combine's bits"  # fmt: skip


def _fresh(inp, c: int, rank: int, world: int):
    """New tokens, routing and weights of the same shapes, kinds and dtypes, written
    into the tensors a captured graph holds."""
    t, k = inp.ids.shape
    inp.x.copy_(torch.randn(t, inp.x.shape[1]).to(inp.x.dtype))
    inp.ids.copy_(_ids(inp.kind, t, k, inp.num_experts, world, c + 7 * rank))
    inp.w.copy_(torch.randn(t, k).to(inp.w.dtype))


def cases_body(rank, world, use_gpu):
    """Every routing case of test_moe (on more than one CPU rank: its share of them,
    test_moe.runs_case_here), eager, then replayed REPLAYS times with fresh inputs,
    each judged; every replay counted on the device (two epochs: one per op)."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    max_tokens = 200 if use_gpu else 24  # test_moe.make_inputs' most tokens per rank
    judged = 0
    for c, case in enumerate(CASES):
        if not runs_case_here(world, use_gpu, c):
            continue
        inp = make_inputs(case, c, rank, world, device, use_gpu)
        what = f"case {c} {case[0]} k={case[1]}"
        plans: dict = {}
        outs = _graph_outputs(ok, plans, inp, _expert_outputs(inp), max_tokens, replay=False)
        check_case(dist, "combine", inp, outs, f"{what} eager")
        _same_bits_as_moe_combine(ok, inp, outs, f"{what} eager")
        judged += 1
        for name in ("dispatch", "back", "out"):
            if plans[name].replay_state is None:  # (CUDA's eager call prepared it)
                plans[name].prepare_replay()
        ws = plans["dispatch"].replay_state.ws
        epochs = int(ws.chunk_flags[REPLAY_EPOCH_SLOT])
        for r in range(REPLAYS):
            _fresh(inp, c + r + 1, rank, world)
            outs = _graph_outputs(ok, plans, inp, _expert_outputs(inp), max_tokens, replay=True)
            ok.raise_if_failed()
            check_case(dist, "combine", inp, outs, f"{what} replay {r}")
            _same_bits_as_moe_combine(ok, inp, outs, f"{what} replay {r}")
            counted = int(ws.chunk_flags[REPLAY_EPOCH_SLOT]) - epochs
            assert counted == 3 * (r + 1), f"{what}: {counted} device epochs after {r + 1} replays"
            judged += 1
    return judged


@pytest.mark.parametrize("world", [1, *CPU_SHARED_WORLDS])
def test_every_routing_case_eager_and_replayed_cpu(world):
    cases = sum(runs_case_here(world, False, c) for c in range(len(CASES)))
    assert run_ranks(cases_body, world, False) == [cases * (1 + REPLAYS)] * world


# ---- capacity and routing errors ------------------------------------------------


def _hot_inputs(rank, world, device, t: int, hot: bool):
    """t tokens of dim 16, 2 * world experts: every token to both experts of the
    last rank (``hot``), or to one expert of rank 0 and an unused slot."""
    ids = [[2 * world - 1, 2 * world - 2]] * t if hot else [[1, -1]] * t
    x = torch.randn(t, 16, device=device).to(BF16)
    return x, torch.tensor(ids, device=device), torch.rand(t, 2, device=device) + 0.1


def _right(ok, recv_x, handle, x, ids, w, e: int, what: str) -> None:
    """recv_x's rows are moe_dispatch's, bit for bit, and its round trip through
    moe_combine_graph is x times the token's weights, within the contract's bound."""
    want, _ = ok.moe_dispatch(x, ids, w, num_experts=e)
    rows, _, _ = _view(recv_x, handle)
    assert torch.equal(_bits(rows.cpu()), _bits(want.cpu())), f"{what}: recv_x"
    back = ok.moe_combine_graph(recv_x, handle)
    weights = torch.where(ids >= 0, w.double(), 0.0).sum(1, keepdim=True).cpu()
    ref = x.double().cpu() * weights
    problem = combine_problem(back, ref, ref.abs(), 0.0, ids.shape[1], x.dtype, x.device, "round trip")  # fmt: skip
    assert problem is None, f"{what}: {problem}"


def errors_body(rank, world, use_gpu):
    """Each failure the count matrix shows is raised on every rank, once, naming the
    rank and the numbers, eager and replayed, and the next call is right; a replay
    that no eager call prepared is refused; a rank that skips a replay gives its
    peers the timeout, named as replayed."""
    import overlap_kernels as ok
    from overlap_kernels.ops.moe_graph import MoeCapacityError

    dist, device = setup_rank(rank, use_gpu)
    e, t, hot = 2 * world, 4, world - 1
    config = {"timeout_s": 20.0}
    kw = {"num_experts": e, "max_tokens_per_rank": t, "max_topk": 2, "config": config}
    pairs = 2 * t * world  # every token of every rank to the hot rank's two experts
    # 1. The hot rank's capacity one row short (local: its peers keep theirs).
    capacity = pairs - 1 if rank == hot else pairs
    x, ids, w = _hot_inputs(rank, world, device, t, hot=True)
    overflow = rf"moe_dispatch_graph: rank {hot} would receive {pairs} rows, more than its capacity of {pairs - 1} "  # fmt: skip
    with pytest.raises(MoeCapacityError, match="^" + overflow):
        ok.moe_dispatch_graph(x, ids, w, **kw, max_recv_rows=capacity)
        ok.raise_if_failed()  # (CUDA: the kernel may end after the call returns)
    _right(ok, *ok.moe_dispatch_graph(x, ids, w, **kw), x, ids, w, e, "after the capacity error")
    # 2. More tokens than max_tokens_per_rank on one rank, a top-k above max_topk, an
    # expert id out of range: each on one rank, raised on every rank.
    bad = {"tokens": 0, "topk": min(1, hot), "ids": hot}
    for kind, error, pattern in (
        ("tokens", MoeCapacityError, rf"rank {bad['tokens']} passed {t + 3} tokens, more than max_tokens_per_rank = {t}"),
        ("topk", MoeCapacityError, rf"rank {bad['topk']} routes top-3, more than max_topk = 2"),
        ("ids", ValueError, rf"topk_ids values outside \[-1, {e}\) \(rank {bad['ids']}: 1 of them\)"),
    ):  # fmt: skip
        bx, bids, bw = _hot_inputs(rank, world, device, t + 3 * (kind == "tokens" and rank == bad[kind]), hot=False)  # fmt: skip
        if kind == "topk" and rank == bad[kind]:
            bids, bw = torch.cat([bids, bids[:, :1]], 1), torch.rand(t, 3, device=device)
        if kind == "ids" and rank == bad[kind]:
            bids[t // 2, 1] = e + 5
        with pytest.raises(error, match=pattern) as raised:
            ok.moe_dispatch_graph(bx, bids, bw, **kw)
            ok.raise_if_failed()
        assert (kind == "ids") != isinstance(raised.value, MoeCapacityError), raised.value
        _right(ok, *ok.moe_dispatch_graph(x, ids, w, **kw), x, ids, w, e, f"after {kind}")
    # 3. Replayed: the capacity fixed at capture, the routing overflowing it or not.
    plan = dispatch_plan(x, None, e, t, 2, config)
    if plan.replay_state is None:  # (the CPU: no eager call prepares a replay)
        with pytest.raises(ok.OverlapInputError, match="no eager call of this signature prepared its replay"):  # fmt: skip
            plan(x, ids, w, capacity, replay=True)
        plan.prepare_replay()
    for i, overflowing in enumerate((True, False, True, False)):
        for held, new in zip((x, ids, w), _hot_inputs(rank, world, device, t, hot=overflowing)):
            held.copy_(new)  # new values in the tensors a graph holds
        recv_x, handle = plan(x, ids, w, capacity, replay=True)
        if overflowing:
            with pytest.raises(MoeCapacityError, match="^" + overflow):
                ok.raise_if_failed()
        else:
            ok.raise_if_failed()
            want, _ = ok.moe_dispatch(x, ids, w, num_experts=e)
            rows, _, _ = _view(recv_x, handle)
            assert torch.equal(_bits(rows.cpu()), _bits(want.cpu())), f"replay {i}: recv_x"
    # 4. A rank that skips a replay: its peers' waits time out, named as replayed.
    if world > 1:
        short = {"timeout_s": 3.0}
        ok.moe_dispatch_graph(x, ids, w, **{**kw, "config": short})  # its plan; on CUDA its replay
        skipped = dispatch_plan(x, None, e, t, 2, short)
        if skipped.replay_state is None:
            skipped.prepare_replay()
        if rank != 0:
            start = time.monotonic()
            skipped(x, ids, w, capacity, replay=True)
            timed_out = r"moe_dispatch_graph.*\(replayed in a CUDA graph\): rank \d+ waited more than 3 s for rank 0"  # fmt: skip
            with pytest.raises(ok.OverlapTimeoutError, match=timed_out):
                ok.raise_if_failed()
            assert time.monotonic() - start < 15, "the 3 s deadline, not a hang"
        dist.barrier()  # rank 0 stays alive (and mapped) while its peers wait in vain
        ok.reset_workspaces()
        _right(ok, *ok.moe_dispatch_graph(x, ids, w, **kw), x, ids, w, e, "after reset_workspaces")
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_capacity_and_routing_errors_raise_on_every_rank_cpu(world):
    assert run_ranks(errors_body, world, False) == [True] * world


# ---- GPUs: one captured graph, replayed ------------------------------------------


def captured_layer_body(rank, world, use_gpu, replays, whole):
    """dispatch -> gate/up torch._grouped_mm -> silu(gate) * up -> down -> combine
    (``whole``: the one call moe_mlp(..., max_tokens_per_rank)), captured once after
    an eager call, replayed ``replays`` times with fresh tokens and routings (kinds
    cycling: distinct top-8, holes, all to one expert, any), each against float64
    (test_moe's MLP bound); two device epochs per replay."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    h, f, k, max_tokens, e_local = 256, 128, 8, 32, 4
    e = e_local * world
    t = max_tokens - 3 * rank  # local: T differs between ranks
    inp = SimpleNamespace(
        kind="topk", k=k, e_local=e_local, num_experts=e, dtype=BF16,
        x=torch.randn(t, h, device=device).to(BF16), ids=torch.zeros(t, k, dtype=torch.long, device=device),
        w=torch.zeros(t, k, device=device), wgu=_weight(e_local, h, 2 * f, BF16, device),
        wd=_weight(e_local, f, h, BF16, device),
    )  # fmt: skip
    inp.w1, inp.w2 = inp.wgu, inp.wd  # (check_case gathers them; the MLP reads wgu and wd)
    kw = {"num_experts": e, "max_tokens_per_rank": max_tokens, "config": {"timeout_s": 60.0}}

    def layer():
        if whole:
            return ok.moe_mlp(inp.x, inp.ids, inp.w, inp.wgu, inp.wd, **kw)
        recv_x, handle = ok.moe_dispatch_graph(inp.x, inp.ids, inp.w, **kw)
        gate_up = torch._grouped_mm(recv_x, inp.wgu, offs=handle.expert_ends)
        act = (torch.nn.functional.silu(gate_up[:, :f].float()) * gate_up[:, f:].float()).to(BF16)
        y = torch._grouped_mm(act, inp.wd, offs=handle.expert_ends)
        return ok.moe_combine_graph(y, handle)

    kinds = ("topk", "holes", "skewed", "any")
    _fresh(inp, 0, rank, world)
    check_case(dist, "mlp", inp, {"out": layer()}, "eager")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    # (moe_mlp's dispatch is called with the config moe_mlp resolved, so its plan is keyed by that)
    config = moe_config(kw["config"], h, e, world, BF16) if whole else kw["config"]
    ws = dispatch_plan(inp.x, None, e, max_tokens, k, config).replay_state.ws
    epochs = int(ws.chunk_flags[REPLAY_EPOCH_SLOT])
    for r in range(replays):
        inp.kind = kinds[r % len(kinds)]
        _fresh(inp, r + 1, rank, world)
        out.fill_(math.nan)  # poisoned: a replay that writes nothing fails
        graph.replay()
        torch.cuda.synchronize()
        ok.raise_if_failed()
        check_case(dist, "mlp", inp, {"out": out}, f"replay {r} ({inp.kind})")
        counted = int(ws.chunk_flags[REPLAY_EPOCH_SLOT]) - epochs
        assert counted == 2 * (r + 1), f"{counted} device epochs after {r + 1} replays"
    return replays


@gpu_ranks(worlds=(2, 4))
def test_captured_dispatch_grouped_gemm_combine_replays_gpu(world, gpus, backend):
    assert run_on_gpus(captured_layer_body, world, gpus, backend, GPU_REPLAYS, False, timeout_s=600) == [GPU_REPLAYS] * world  # fmt: skip


@gpu_ranks(worlds=(2, 4))
def test_captured_moe_mlp_in_graph_mode_replays_gpu(world, gpus, backend):
    assert run_on_gpus(captured_layer_body, world, gpus, backend, GPU_REPLAYS, True, timeout_s=600) == [GPU_REPLAYS] * world  # fmt: skip


@gpu_ranks(worlds=(2, 4))
def test_every_routing_case_eager_and_replayed_gpu(world, gpus, backend):
    assert run_on_gpus(cases_body, world, gpus, backend) == [len(CASES) * (1 + REPLAYS)] * world


@gpu_ranks(worlds=(2,))
def test_capacity_and_routing_errors_raise_on_every_rank_gpu(world, gpus, backend):
    assert run_on_gpus(errors_body, world, gpus, backend) == [True] * world


def test_operands_that_require_grad_are_refused_naming_the_differentiable_pair():
    """Before any plan or group is looked at: the graph mode records no gradient."""
    import overlap_kernels as ok

    x, ids, w = torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.rand(2, 1)
    with pytest.raises(ok.OverlapInputError, match=r"^moe_dispatch_graph: an operand requires grad.*functional\.moe_dispatch"):  # fmt: skip
        ok.moe_dispatch_graph(x.requires_grad_(), ids, w, num_experts=2, max_tokens_per_rank=2)
    with pytest.raises(ok.OverlapInputError, match=r"^moe_combine_graph: an operand requires grad.*functional\.moe_combine"):  # fmt: skip
        ok.moe_combine_graph(torch.randn(4, 8, requires_grad=True), None)


def test_the_host_sized_path_refuses_capture_pointing_to_the_graph_mode(monkeypatch):
    """moe_dispatch, moe_combine and moe_gemm_combine read the counts on the host: a
    capture is refused (on GPUs: tests/test_graph_capture.py), naming the graph mode."""
    import overlap_kernels as ok
    from overlap_kernels.ops.moe_details import steps

    monkeypatch.setattr(steps, "capturing", lambda device: True)
    with pytest.raises(ok.OverlapInputError, match=r"^moe_dispatch: its symmetric-memory steps cannot be captured.*moe_dispatch_graph and moe_combine_graph"):  # fmt: skip
        steps.refuse_capture("moe_dispatch", torch.device("cpu"))
