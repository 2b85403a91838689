"""What every rank must decide alike in the MoE ops, and what must fail alike.

- "auto": ranks route different numbers of tokens (5, 9, 7); ``fused_max_tokens``
  at the largest of them sends every rank down the fused path, one below it
  down ``auto_path``. Deciding from a rank's own T would split the ranks between
  two protocols (and hang); the result is checked against fp32 on each path.
- Ranks that disagree on H or num_experts, or on the width of the rows they
  combine, raise on every rank (each rank's offsets, workspace growth and
  reads come from them), and the next call works; so do ranks that combine
  different widths each had combined before (OverlapMismatchError).
- A call signature leaves the token count open: calls with other T (here, of
  every rank) make no new plan (ops/plans.py).
- What is local to a rank by design (topk_ids' dtype, topk_weights' dtype, k, T)
  may differ between ranks and from call to call: the calls are right and fast.
  A real disagreement in a dispatching call is named on every rank in that
  call, whether each rank's plan is new or cached, and the next call works.
- A handle from before reset_workspaces() is refused, not used.
- One output column (N = 1): a contiguous weight is not taken for a transposed one.
"""

from __future__ import annotations

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels.launch import run_ranks

TOKENS = (5, 9, 7)


def paths_body(rank: int, world: int) -> list[str]:
    import overlap_kernels as ok

    torch.manual_seed(17 + rank)
    t, h, n, num_experts = TOKENS[rank], 32, 24, 2 * world
    x = torch.randn(t, h)
    topk_ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(t)])
    topk_weights = torch.rand(t, 2)
    w1 = torch.randn(2, h, n)
    taken = []
    for limit in (max(TOKENS[:world]), max(TOKENS[:world]) - 1):
        config = {"path": "auto", "auto_path": "unfused", "fused_max_tokens": limit}
        out, handle = ok.moe_dispatch_gemm(
            x, topk_ids, topk_weights, w1, num_experts=num_experts, config=config
        )
        recv_x, _ = ok.moe_dispatch(x, topk_ids, topk_weights, num_experts=num_experts)
        experts = torch.repeat_interleave(torch.arange(2), torch.tensor(handle.expert_counts))
        reference = (
            torch.stack([recv_x[i] @ w1[e] for i, e in enumerate(experts.tolist())])
            if len(experts)
            else out
        )
        torch.testing.assert_close(
            out, reference, rtol=1e-5, atol=1e-5
        )  # fp32: summation order only
        taken.append(handle.path)
        # resolve_config predicts it from the largest T (what the bench records).
        predicted = ok.ops.moe.resolve_config(
            x,
            topk_ids,
            topk_weights,
            w1,
            w1,
            num_experts=num_experts,
            config=config,
            max_tokens=max(TOKENS[:world]),
        )
        assert predicted.path == handle.path
    return taken


@pytest.mark.parametrize("world", [2, 3])
def test_auto_path_is_decided_alike_on_every_rank(world):
    assert run_ranks(paths_body, world) == [["fused", "unfused"]] * world


def disagreement_body(rank: int, world: int) -> list[str]:
    import overlap_kernels as ok
    from overlap_kernels.ops import plans

    ids = torch.tensor([[0, 1], [1, 0], [0, -1]])
    weights = torch.rand(3, 2)
    raised = []
    for hidden, num_experts in ((32 + 8 * rank, 2 * world), (32, 2 * world * (rank + 1))):
        with pytest.raises(
            ok.OverlapInputError, match="the ranks of the group disagree on"
        ) as error:
            ok.moe_dispatch(torch.randn(3, hidden), ids, weights, num_experts=num_experts)
        raised.append(str(error.value).split(":")[1].strip())
    x = torch.randn(3, 32)
    recv_x, handle = ok.moe_dispatch(
        x, ids, weights, num_experts=2 * world
    )  # works after the errors
    expected = x * weights.masked_fill(ids < 0, 0).sum(1, keepdim=True)
    torch.testing.assert_close(ok.moe_combine(recv_x, handle), expected)
    # Rows of different widths, new to every rank: every rank raises before
    # anything moves. (A rank whose width it combined before makes no new plan,
    # so its peers' agreement times out instead: ops/plans.agree.)
    with pytest.raises(ok.OverlapInputError, match="disagree on rows") as error:
        ok.moe_combine(torch.randn(recv_x.shape[0], 24 + 16 * rank), handle)
    raised.append(str(error.value).split(":")[1].strip())
    torch.testing.assert_close(ok.moe_combine(recv_x, handle), expected)
    # Other token counts (two, then all three of this rank's) are the same signature.
    dispatches = plans.made["moe_dispatch"]
    for t in (2, 3):
        ok.moe_dispatch(x[:t], ids[:t], weights[:t], num_experts=2 * world)
    assert plans.made["moe_dispatch"] == dispatches
    ok.reset_workspaces()
    with pytest.raises(ok.OverlapInputError, match="before reset_workspaces"):
        ok.moe_combine(recv_x, handle)
    return raised


def test_ranks_that_disagree_raise_alike_and_stale_handles_are_refused():
    assert (
        run_ranks(disagreement_body, 2)
        == [
            [
                "the ranks of the group disagree on x",
                "the ranks of the group disagree on num_experts",
                "the ranks of the group disagree on rows",
            ]
        ]
        * 2
    )


def known_widths_body(rank: int, world: int) -> str:
    import overlap_kernels as ok

    ids, weights = torch.tensor([[0, 1], [1, 0], [0, -1]]), torch.rand(3, 2)
    recv_x, handle = ok.moe_dispatch(torch.randn(3, 32), ids, weights, num_experts=2 * world)
    rows = recv_x.shape[0]
    for width in (24, 40):  # every rank combines both widths: both plans agreed on
        ok.moe_combine(torch.randn(rows, width), handle)
    with pytest.raises(ok.OverlapMismatchError) as error:
        ok.moe_combine(torch.randn(rows, 24 if rank == 0 else 40), handle)
    ok.reset_workspaces()
    x = torch.randn(3, 32)  # a fresh dispatch and combine after the reset are right
    recv_x, handle = ok.moe_dispatch(x, ids, weights, num_experts=2 * world)
    expected = x * weights.masked_fill(ids < 0, 0).sum(1, keepdim=True)
    torch.testing.assert_close(ok.moe_combine(recv_x, handle), expected)
    return str(error.value).split(". Every rank")[0].rsplit(". ", 1)[1]


def test_ranks_that_combine_different_known_widths_raise():
    """Both widths planned before, so no agreement meets: the combine's
    announcements carry each rank's signature word (runtime/signals.py)."""
    assert run_ranks(known_widths_body, 2) == [
        "They differ in rows ([*, 24] float32 vs [*, 40] float32)",
        "They differ in rows ([*, 40] float32 vs [*, 24] float32)",
    ]


def one_column_body(rank: int, world: int) -> None:
    import overlap_kernels as ok
    from overlap_kernels.reference import check_matmul

    torch.manual_seed(3 + rank)
    x = torch.randn(6, 32, dtype=torch.float16)
    ids = torch.randint(0, 2 * world, (6, 2))
    w1 = torch.randn(2, 32, 1, dtype=torch.float16)  # contiguous, N = 1: stride(1) == 1 too
    for path in ("fused", "unfused"):
        h, handle = ok.moe_dispatch_gemm(
            x, ids, torch.rand(6, 2), w1, num_experts=2 * world, config={"path": path}
        )
        recv_x, _ = ok.moe_dispatch(x, ids, torch.rand(6, 2), num_experts=2 * world)
        start = 0
        for e, rows in enumerate(handle.expert_counts):
            if rows:  # the library's matmul oracle, expert by expert
                check_matmul(
                    h[start : start + rows],
                    recv_x[start : start + rows],
                    w1[e],
                    f"{path} expert {e}",
                )
            start += rows


def test_one_output_column_is_not_taken_for_a_transposed_weight():
    run_ranks(one_column_body, 2)


# ---- what is local to a rank, and what must agree --------------------------------


def _deadline_s(use_gpu: bool) -> float:
    """A call that waited for a peer would take this long; the calls here take ~1 s
    on CPU ranks, and on GPUs up to a few seconds more where a kernel compiles."""
    return 120.0 if use_gpu else 20.0


def _round_trip(x, weights, ids) -> torch.Tensor:
    """What moe_combine(moe_dispatch(x)) gives: each token times the sum of its
    used slots' weights (fp32, as the combine weights and sums)."""
    return x * weights.float().masked_fill(ids < 0, 0).sum(1, keepdim=True)


def local_differences_body(rank: int, world: int, use_gpu: bool = False) -> int:
    """Ranks whose topk_ids dtype (int32 on one rank), topk_weights dtype, top-k
    width and token count differ make the same plans: the calls are right and
    fast, whether a rank's plan is new or cached (a rank switches its ids' dtype
    between calls, its peers do not)."""
    import time

    import overlap_kernels as ok

    _, device = setup_rank(rank, use_gpu)
    deadline = _deadline_s(use_gpu)
    num_experts, config = 2 * world, {"timeout_s": deadline}
    k = 3 if rank == world - 1 else 2  # a wider routing on one rank
    w1 = torch.randn(2, 16, 8, device=device)
    taken = []
    for call, int32_rank in enumerate((0, None, 0, 1)):
        t = 4 + rank + call
        x = torch.randn(t, 16, device=device)
        ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(t)])
        ids[0, -1] = -1
        ids = (ids.int() if rank == int32_rank else ids).to(device)
        weights = torch.rand(t, k, dtype=torch.bfloat16 if rank == 1 else torch.float32).to(device)
        start = time.monotonic()
        recv_x, handle = ok.moe_dispatch(x, ids, weights, num_experts=num_experts, config=config)
        out = ok.moe_combine(recv_x, handle)
        h, gemm_handle = ok.moe_dispatch_gemm(x, ids, weights, w1, num_experts=num_experts,
                                              config={**config, "path": "unfused"})  # fmt: skip
        ok.raise_if_failed()
        taken.append(time.monotonic() - start)
        torch.testing.assert_close(out, _round_trip(x, weights, ids))  # fp32: summation order only
        assert gemm_handle.expert_counts == handle.expert_counts
        ends = [0, *torch.tensor(handle.expert_counts).cumsum(0).tolist()]
        for e in range(2):  # fp32, K = 16: summation order only
            rows = slice(ends[e], ends[e + 1])
            torch.testing.assert_close(h[rows], recv_x[rows] @ w1[e], rtol=1e-5, atol=1e-5)
    assert max(taken) < deadline / 2, f"a call waited for a peer: {taken}"
    return len(taken)


def test_local_differences_between_ranks_just_work():
    """The 3-rank call that once waited out the deadline on every rank."""
    assert run_ranks(local_differences_body, 3) == [4] * 3


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_local_differences_between_ranks_just_work_gpu(world, gpus, backend):
    assert run_on_gpus(local_differences_body, world, gpus, backend) == [4] * world


def real_disagreement_body(rank: int, world: int, use_gpu: bool = False) -> list[str]:
    """A rank that calls other shapes, or another op, than its peers, with its
    plan new while theirs are cached, or with every plan cached: every rank
    raises OverlapInputError naming what differs, at once (no deadline), and
    the next call is right."""
    import time

    import overlap_kernels as ok

    _, device = setup_rank(rank, use_gpu)
    deadline = _deadline_s(use_gpu)
    num_experts, config = 2 * world, {"timeout_s": deadline}
    ids = torch.tensor([[0, 1], [1, 0], [0, -1]], device=device)
    weights = torch.rand(3, 2, device=device)
    wgu, wd = torch.randn(2, 32, 16, device=device), torch.randn(2, 8, 32, device=device)

    def dispatch(hidden):
        return ok.moe_dispatch(torch.randn(3, hidden, device=device), ids, weights,
                               num_experts=num_experts, config=config)  # fmt: skip

    def still_right():
        x = torch.randn(3, 32, device=device)
        recv_x, handle = ok.moe_dispatch(x, ids, weights, num_experts=num_experts, config=config)
        torch.testing.assert_close(ok.moe_combine(recv_x, handle), _round_trip(x, weights, ids))

    def mlp():
        x = torch.randn(3, 32, device=device)
        return ok.moe_mlp(x, ids, weights, wgu, wd, num_experts=num_experts, config=config)

    dispatch(32)  # every rank: H = 32 planned
    mlp()  # (its kernels loaded before any call is timed)
    named, taken = [], []
    calls = [
        lambda: dispatch(40 if rank == 0 else 32),  # rank 0's plan new, its peers' cached
        lambda: dispatch(40),  # (agreed: every rank has both plans now)
        lambda: dispatch(32 if rank == 0 else 40),  # every plan cached
        lambda: dispatch(32) if rank == 0 else mlp(),  # another op
    ]
    for i, call in enumerate(calls):
        start = time.monotonic()
        if i == 1:
            call()
            continue
        with pytest.raises(ok.OverlapInputError, match="the ranks of the group disagree on") as e:
            call()
        taken.append(time.monotonic() - start)
        named.append(str(e.value).split(":")[1].strip())
        assert "no token was sent" in str(e.value), e.value
        still_right()
    assert max(taken) < deadline / 2, f"a rank waited for the deadline: {taken}"
    return named


_NAMED = [
    "the ranks of the group disagree on x",
    "the ranks of the group disagree on x",
    "the ranks of the group disagree on op",
]


def test_real_disagreement_is_named_at_once_on_every_rank():
    assert run_ranks(real_disagreement_body, 3) == [_NAMED] * 3


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_real_disagreement_is_named_at_once_on_every_rank_gpu(world, gpus, backend):
    assert run_on_gpus(real_disagreement_body, world, gpus, backend) == [_NAMED] * world
