"""all_reduce and all_reduce_rmsnorm on 1-3 CPU ranks (Triton's interpreter) and on
1-4 GPU ranks: every path against float64, element by element, and every rank's
result the same bits; bad input refused before any launch; ranks that disagree named."""

from __future__ import annotations

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_add_rmsnorm, check_sum, poisoned

# (M, N): one token, odd sizes, several column blocks (block_cols 16 in CASES' configs)
SHAPES = ((1, 8), (3, 40), (5, 16), (16, 24))
PATHS = ("one_shot", "sequential")


def _gather(dist, t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return [p.cpu() for p in parts]


def _same_on_every_rank(dist, t: torch.Tensor, what: str) -> None:
    for rank, other in enumerate(_gather(dist, t)):
        assert torch.equal(other, t.cpu()), f"{what}: rank {rank}'s result differs in its bits"


def ops_body(rank, world, use_gpu, dtypes):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    checked = 0
    for dtype in dtypes:
        for m, n in SHAPES:
            for path in PATHS:
                config = {"path": path, "block_cols": 16, "timeout_s": 30.0}
                what = f"{dtype} {m}x{n} {path}"
                # the plain path's collective adds in the dtype: world - 1 more roundings
                in_dtype = world - 1 if path == "sequential" else 0
                x = torch.randn(m, n, dtype=dtype, device=device)
                xs = _gather(dist, x)
                out = poisoned((m, n), dtype, device)
                assert ok.all_reduce(x, config=config, out=out) is out
                check_sum(out.cpu(), xs, f"all_reduce {what}", in_dtype=in_dtype)
                _same_on_every_rank(dist, out, f"all_reduce {what}")
                # The residual is replicated, as a decoder layer's is.
                residual = torch.randn(m, n, dtype=dtype, device=device)
                dist.broadcast(residual, 0)
                weight = (torch.rand(n, device=device) + 0.5).to(dtype)
                dist.broadcast(weight, 0)
                for with_residual in (True, False):
                    given = residual if with_residual else None
                    normed, summed = ok.all_reduce_rmsnorm(x, given, weight, 1e-5, config=config)
                    check_add_rmsnorm(normed.cpu(), summed.cpu(), xs, residual.cpu() if with_residual else None,
                                      weight.cpu(), 1e-5, f"all_reduce_rmsnorm {what} residual={with_residual}",
                                      in_dtype=in_dtype)  # fmt: skip
                    _same_on_every_rank(dist, normed, f"normed {what}")
                    checked += 1
                # In place: residual_out is the residual (a decoder layer's update).
                expected = ok.all_reduce_rmsnorm(x, residual, weight, 1e-5, config=config)
                updated = residual.clone()
                normed, summed = ok.all_reduce_rmsnorm(x, updated, weight, 1e-5, config=config,
                                                       residual_out=updated)  # fmt: skip
                assert summed is updated
                assert torch.equal(summed, expected[1]) and torch.equal(normed, expected[0]), what
    ok.raise_if_failed()
    return checked


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_path_against_fp64_cpu(world):
    expected = 2 * len(SHAPES) * len(PATHS) * 2
    assert run_ranks(ops_body, world, False, (torch.float32, torch.bfloat16)) == [expected] * world


@gpu_ranks(worlds=(1, 2, 4))
def test_every_path_against_fp64_gpu(world, gpus, backend):
    expected = 3 * len(SHAPES) * len(PATHS) * 2
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    assert run_on_gpus(ops_body, world, gpus, backend, dtypes) == [expected] * world


def bad_input_body(rank, world, use_gpu):
    """Each bad call raises OverlapInputError naming the problem, before any launch:
    the workspace's epoch does not move."""
    import overlap_kernels as ok
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(4, 32, device=device)
    weight = torch.ones(32, device=device)
    ok.all_reduce(x, config={"path": "one_shot"})  # the workspace exists
    ok.all_reduce_rmsnorm(x, x.clone(), weight)  # a norm plan cached: its calls are checked too
    epoch = get_workspace(None, device).epoch
    cases = {
        "must be 2-D": lambda: ok.all_reduce(x[0]),
        "dtype torch.int32": lambda: ok.all_reduce(x.int()),
        "must be contiguous": lambda: ok.all_reduce(x.t()),
        r"residual has shape \(4, 16\)": lambda: ok.all_reduce_rmsnorm(x, x[:, :16], weight),
        "residual is torch.float16": lambda: ok.all_reduce_rmsnorm(x, x.half(), weight),
        # (the cached plan's residual had these strides: only its shape differs)
        r"residual has shape \(2, 32\)": lambda: ok.all_reduce_rmsnorm(x, x[:2].clone(), weight),
        r"norm_weight has shape \(16,\), expected \[N\] = \[32\]": lambda: ok.all_reduce_rmsnorm(
            x, x, weight[:16]
        ),
        "eps must be a number > 0": lambda: ok.all_reduce_rmsnorm(x, x, weight, 0.0),
        r"out has shape \(4, 16\)": lambda: ok.all_reduce(x, out=x[:, :16].clone()),
        "out overlaps an input": lambda: ok.all_reduce(x, out=x),
        "path must be one of": lambda: ok.all_reduce(x, config={"path": "two_shot"}),
        "block_cols must be a power of two": lambda: ok.all_reduce(x, config={"block_cols": 24}),
        "records no gradient": lambda: ok.all_reduce(x.clone().requires_grad_()),
    }
    for message, call in cases.items():
        with pytest.raises(ok.OverlapInputError, match=message):
            call()
    assert get_workspace(None, device).epoch == epoch
    return len(cases)


def test_bad_input_is_refused_before_launch_cpu():
    assert len(set(run_ranks(bad_input_body, 2, False))) == 1


def disagree_body(rank, world, use_gpu):
    """Ranks with different N, or one without a residual, all raise the agreement error at once."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    n = 32 if rank == 0 else 48
    raised = 0
    with pytest.raises(ok.OverlapInputError, match="disagree on x"):
        ok.all_reduce(torch.randn(2, n, device=device), config={"timeout_s": 20.0})
    raised += 1
    x, weight = torch.randn(2, 32, device=device), torch.ones(32, device=device)
    residual = x.clone() if rank == 0 else None
    with pytest.raises(ok.OverlapInputError, match="disagree on residual"):
        ok.all_reduce_rmsnorm(x, residual, weight, config={"timeout_s": 20.0})
    raised += 1
    return raised


def test_ranks_that_disagree_are_named_cpu():
    assert run_ranks(disagree_body, 2, False) == [2, 2]


def gemm_body(rank, world, use_gpu, dtypes):
    """gemm_ar_rmsnorm equals all_reduce_rmsnorm of this rank's torch.matmul product,
    bit for bit (the product is that matmul's), on every path; the norm of the
    reduction is judged against float64 by the tests above."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    checked = 0
    for dtype in dtypes:
        for m, k, n in ((1, 16, 24), (5, 32, 40)):
            for path in PATHS:
                config = {"path": path, "block_cols": 16, "timeout_s": 30.0}
                x = torch.randn(m, k, dtype=dtype, device=device)
                w = torch.randn(n, k, dtype=dtype, device=device).t()  # nn.Linear's layout
                residual = torch.randn(m, n, dtype=dtype, device=device)
                weight = (torch.rand(n, device=device) + 0.5).to(dtype)
                for t in (residual, weight):
                    dist.broadcast(t, 0)
                expected = ok.all_reduce_rmsnorm(torch.matmul(x, w), residual, weight, 1e-6,
                                                 config=config)  # fmt: skip
                normed, summed = ok.gemm_ar_rmsnorm(x, w, residual, weight, 1e-6, config=config)
                what = f"{dtype} {m}x{k}x{n} {path}"
                assert torch.equal(summed, expected[1]), f"residual_out {what}"
                assert torch.equal(normed, expected[0]), f"normed {what}"
                # Without a residual: the sum alone is residual_out.
                alone = ok.all_reduce_rmsnorm(torch.matmul(x, w), None, weight, 1e-6, config=config)
                got = ok.gemm_ar_rmsnorm(x, w, None, weight, 1e-6, config=config)
                assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1]), what
                checked += 1
    ok.raise_if_failed()
    return checked


@pytest.mark.parametrize("world", [1, 2])
def test_gemm_ar_rmsnorm_cpu(world):
    assert run_ranks(gemm_body, world, False, (torch.float32,)) == [2 * len(PATHS)] * world


@gpu_ranks(worlds=(1, 2, 4))
def test_gemm_ar_rmsnorm_gpu(world, gpus, backend):
    dtypes = (torch.bfloat16, torch.float16)
    assert run_on_gpus(gemm_body, world, gpus, backend, dtypes) == [4 * len(PATHS)] * world
