"""FusedOp and overlap_kernels.language on CPU rank processes: an all-gather and a
reduce-scatter written with the API (exact against the collectives), and its
misuse: a schedule that leaves rows out, chunks that nothing sends, a kernel
that forgets to signal or to finish, ranks whose calls differ; each gives a
clear error before anything is launched, or the timeout (never a hang); and a
user's op registered as a torch custom op the way ours are."""

from __future__ import annotations

import time

import pytest
import torch

from overlap_kernels import FusedOp, OverlapInputError  # (before Triton: the interpreter)

# isort: split
import triton
import triton.language as tl
from ranks import setup_rank

from overlap_kernels import language as ol
from overlap_kernels.launch import run_ranks

_CONFIG = {"block_m": 16, "block_n": 16, "timeout_s": 20.0}


@triton.jit
def _all_gather_kernel(x_ptr, out_ptr, N, ctx, FINISH: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    t = ol.next_tile(ctx)
    while t < ol.num_tiles(ctx):
        row_start, row_stop, col_start = ol.tile_rows(ctx, t)
        ol.wait_rows(ctx, t)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        offs = rows[:, None] * N + cols[None, :]
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        t = ol.next_tile(ctx)
    if FINISH:
        ol.finish(ctx)


@triton.jit
def _reduce_scatter_kernel(x_ptr, out_ptr, N, ctx, SIGNAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    t = ol.next_tile(ctx)
    while t < ol.num_tiles(ctx):
        row_start, row_stop, col_start = ol.tile_rows(ctx, t)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_start + tl.arange(0, BLOCK_N)
        mask = (rows < row_stop)[:, None] & (cols < N)[None, :]
        part = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        if ol.is_mine(ctx, t):
            ol.wait_partials(ctx, t)
            acc = ol.add_partials(ctx, t, part.to(tl.float32), out_ptr.dtype.element_ty)
            offs = (rows - ol.first_own_row(ctx))[:, None] * N + cols[None, :]
            tl.store(out_ptr + offs, ol.round_to(acc, out_ptr.dtype.element_ty), mask=mask)
        else:
            ol.put_tile(ctx, t, part)
            if SIGNAL:
                ol.signal_tile(ctx, t)
        t = ol.next_tile(ctx)
    ol.finish(ctx)


def _gather_launch(run, x, finish=True):
    run.launch(_all_gather_kernel, run.gathered, run.out, x.shape[1], run.ctx, FINISH=finish,
               BLOCK_M=run.block_m, BLOCK_N=run.block_n)  # fmt: skip


def _reduce_launch(run, x, signal=True):
    run.launch(_reduce_scatter_kernel, x, run.out, x.shape[1], run.ctx, SIGNAL=signal,
               BLOCK_M=run.block_m, BLOCK_N=run.block_n)  # fmt: skip


ALL_GATHER = FusedOp("all_gather_by_tiles", _gather_launch, kind="gather", config=_CONFIG)
REDUCE_SCATTER = FusedOp("reduce_scatter_by_tiles", _reduce_launch, kind="reduce", config=_CONFIG)


def _gathered(dist, x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def collectives_body(rank, world, use_gpu):
    """The all-gather is exact; the reduce-scatter is within check_sum's bound."""
    from overlap_kernels import schedules as s
    from overlap_kernels.reference import check_sum, poisoned

    dist, device = setup_rank(rank, use_gpu)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 21):
            x = torch.randn(m, 40, dtype=dtype, device=device)
            for schedule in (None, s.split(s.direct(world), 3)):
                out = ALL_GATHER(
                    x, n=40, schedule=schedule, out=poisoned((m * world, 40), dtype, device)
                )
                assert torch.equal(out, _gathered(dist, x)), f"{dtype} m={m} {schedule}"
            for schedule in (None, s.rounds(world, 3, s.PUSH, lag=1)):
                if m < world:  # a rank with no rows would wait for nothing and run ahead
                    with pytest.raises(OverlapInputError, match="every rank must own rows"):
                        REDUCE_SCATTER(x, n=40, schedule=schedule)
                    continue
                out = REDUCE_SCATTER(x, n=40, schedule=schedule)
                start, stop = rank * m // world, (rank + 1) * m // world
                check_sum(out, [p[start:stop] for p in _gathered(dist, x[None])], f"{dtype} m={m}")
    return True


def test_an_all_gather_and_a_reduce_scatter_written_with_the_api_cpu():
    assert run_ranks(collectives_body, 3, False, timeout_s=900) == [True] * 3


def misuse_body(rank, world, use_gpu):
    """Bad schedules and launches raise OverlapInputError before any launch, on every
    rank; a kernel that forgets finish is caught after its launch (CPU); one that
    forgets to signal gives every waiting rank the timeout, after one deadline."""
    import overlap_kernels as ok
    from overlap_kernels import schedules as s
    from overlap_kernels.schedules import COPY_ENGINE, LOCAL, PUSH, Chunk, ChunkSchedule

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(6, 40, device=device)
    # Every rank's own rows, and only the first half of each peer's: the output's rest
    # would never be written.
    half = [[Chunk(r, mechanism=LOCAL)] + [Chunk(p, 0, 2, COPY_ENGINE, flag=p) for p in range(world) if p != r]
            for r in range(world)]  # fmt: skip
    with pytest.raises(
        ok.OverlapInputError, match=r"rows of rank \d: fraction 1/2..1 never arrives"
    ):
        ALL_GATHER(x, n=40, schedule=ChunkSchedule(world, half, "half"))
    # A gather op pulls every peer's chunk; a "push" chunk is one that no step of it sends.
    pushed = s.with_mechanism(s.ring(world), PUSH)
    with pytest.raises(ok.OverlapInputError, match=r"\['push'\] chunks, which nothing would send"):
        ALL_GATHER(x, n=40, schedule=pushed)
    # A producer schedule in which rank 0 never computes its peers' second pieces.
    cut = s.rounds(world, 2)
    cut = ChunkSchedule(world, [cut.chunks[0][: world - 1], *cut.chunks[1:]], "cut")
    with pytest.raises(ok.OverlapInputError, match="never arrive"):
        REDUCE_SCATTER(x, n=40, schedule=cut)
    with pytest.raises(ok.OverlapInputError, match=r"moves partials by push"):
        REDUCE_SCATTER(x, n=40, schedule=s.rounds(world, 1, COPY_ENGINE))
    with pytest.raises(ok.OverlapInputError, match="must call run.launch once"):
        FusedOp("no_launch", lambda run, x: None, kind="gather", config=_CONFIG)(x, n=40)
    with pytest.raises(ok.OverlapInputError, match=r"must call language.finish\(ctx\)"):
        ALL_GATHER(x, False, n=40)
    assert torch.equal(ALL_GATHER(x, n=40), _gathered(dist, x)), "a call after the misuses"
    # A kernel that puts its partials but never signals them: its peers time out.
    start = time.monotonic()
    with pytest.raises(ok.OverlapTimeoutError,
                       match=rf"^reduce_scatter_by_tiles: rank {rank} waited more than 1.5 s for rank \d"):  # fmt: skip
        REDUCE_SCATTER(x, False, n=40, config={"timeout_s": 1.5})
    took = time.monotonic() - start
    dist.barrier()  # every rank stays alive (and mapped) while its peers wait in vain
    ok.reset_workspaces()
    out = REDUCE_SCATTER(x, n=40)  # after reset_workspaces() on every rank, calls work again
    assert out.shape == (6 * (rank + 1) // world - 6 * rank // world, 40)
    return took


def test_misuse_gives_clear_errors_or_the_timeout_never_a_hang_cpu():
    took = run_ranks(misuse_body, 2, False, timeout_s=600)
    assert all(t < 12 for t in took), f"a forgotten signal cost {took} s: more than one deadline"


def mismatch_body(rank, world, use_gpu):
    """Both ranks made both calls before; now rank 0 makes one and rank 1 the
    other. No agreement runs (both plans exist): the signature words their
    signals carry catch it, and each rank raises OverlapMismatchError."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    xs = [torch.randn(m, 40, device=device) for m in (8, 16)]
    for x in xs:
        REDUCE_SCATTER(x, n=40)
    with pytest.raises(ok.OverlapMismatchError, match=r"rank \d and rank \d ran different calls"):
        REDUCE_SCATTER(xs[rank], n=40)
    dist.barrier()
    ok.reset_workspaces()
    return True


def test_ranks_making_different_calls_raise_the_mismatch_cpu():
    assert run_ranks(mismatch_body, 2, False, timeout_s=600) == [True, True]


def custom_op_body(rank, world, use_gpu):
    """examples/ag_swiglu.py as a torch custom op, registered as ours are
    (integrations/torch_ops.py: the group as its name, a fake for tracing),
    called eagerly and under torch.compile(fullgraph=True)."""
    from torch.distributed import distributed_c10d as c10d

    from examples.ag_swiglu import ag_swiglu
    from overlap_kernels.integrations.torch_ops import group_of, name_of
    from overlap_kernels.reference import judge_swiglu_matmul

    dist, device = setup_rank(rank, use_gpu)
    lib = torch.library.Library("overlap_user_ops", "DEF")
    lib.define("ag_swiglu(Tensor x, Tensor w_gate, Tensor w_up, str group_name) -> Tensor",
               tags=(torch.Tag.needs_fixed_stride_order,))  # fmt: skip

    def impl(x, w_gate, w_up, group_name):
        return ag_swiglu(x, w_gate, w_up, group_of(group_name), config=_CONFIG)

    for key in ("CPU", "CUDA"):
        lib.impl("ag_swiglu", impl, key)

    @torch.library.register_fake("overlap_user_ops::ag_swiglu", lib=lib)
    def _(x, w_gate, w_up, group_name):
        return x.new_empty((x.shape[0] * c10d._get_group_size_by_name(group_name), w_gate.shape[1]))

    x = torch.randn(5, 32, device=device)
    w_gate, w_up = torch.randn(32, 48, device=device), torch.randn(32, 48, device=device)
    layer = lambda x: torch.ops.overlap_user_ops.ag_swiglu(x, w_gate, w_up, name_of(None))  # noqa: E731
    for what, fn in (
        ("eager", layer),
        ("compiled", torch.compile(layer, fullgraph=True, backend="aot_eager")),
    ):
        verdict = judge_swiglu_matmul(fn(x), _gathered(dist, x), w_gate, w_up)
        assert verdict.problem is None, f"{what}: {verdict.problem}"
    return True


def test_a_users_op_as_a_torch_custom_op_cpu():
    assert run_ranks(custom_op_body, 2, False, timeout_s=600) == [True, True]


def test_a_relaunch_passes_tensors_and_the_context_anew_and_keys_the_rest_cpu():
    """What Run.launch relaunches a user's kernel by (ops/custom_details/run.py; the
    relaunch itself runs on CUDA alone): a call that differs only in its tensors and
    context reuses the first launch; another scalar (1 and 1.0 apart), dtype, constexpr
    or grid is a different launch; an unaligned tensor, a tuple holding a tensor or any
    other object is never relaunched."""
    from overlap_kernels.language import Context
    from overlap_kernels.ops.custom_details.run import _relaunch_key

    kernel = _all_gather_kernel
    ctx = Context._make(range(len(Context._fields)))
    x, out = torch.zeros(8, 4), torch.zeros(16, 4)

    def key(x=x, out=out, n=4, ctx=ctx, block_m=16, grid=(4,)):
        return _relaunch_key(kernel, grid, (x, out, n, ctx), {"FINISH": True, "BLOCK_M": block_m})

    first, moving = key()
    assert moving == {"x_ptr": x, "out_ptr": out, "ctx": ctx}
    assert (
        key(x=torch.ones(8, 4), out=torch.ones(16, 4), ctx=ctx._replace(epoch=ctx.epoch + 16))[0]
        == first
    )
    assert key(n=5)[0] != first and key(n=4.0)[0] != first
    assert key(block_m=32)[0] != first and key(grid=(8,))[0] != first
    assert key(x=torch.zeros(8, 4, dtype=torch.float64))[0] != first
    for other in (torch.zeros(33)[1:].view(8, 4), (x, out), object()):  # (4 bytes past 16)
        assert key(x=other) == (None, {})
