"""The worked examples of fused ops written by a user (examples/: a Triton kernel
of their own on overlap_kernels.language, plus a schedule, made an op by FusedOp)
on 1-3 CPU rank processes (gloo, host backend, Triton's interpreter) and, behind
``gpu``, on GPUs (2 and 4 ranks sharing one GPU: eager and replayed in CUDA
graphs). Every result is judged against float64 (overlap_kernels/reference.py:
twice the plain unfused path's error, and a per-element bound), with fresh
random inputs and outputs poisoned with NaN, so that an unwritten tile shows."""

from __future__ import annotations

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, runs_here, runs_on_cpu, setup_rank

from overlap_kernels.launch import run_ranks
from overlap_kernels.limits import REPLAY_EPOCH_SLOT

EXAMPLES = ("ag_swiglu", "ag_rmsnorm_gemm", "gemm_rs_bias")
DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-5


def _gather(dist, t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _rows(rank: int, m: int, world: int) -> slice:
    return slice(rank * m // world, (rank + 1) * m // world)


def _schedules(name: str, world: int) -> dict:
    """The default schedule, and one that moves rows in pieces by the other
    mechanism (gather: SM pulls of each peer's rows in two pieces; reduce: two
    pieces per owner, each rank's own piece reduced one round after it is sent)."""
    from overlap_kernels import schedules as s

    if name == "gemm_rs_bias":
        return {"default": None, "rounds(2, lag=1)": s.rounds(world, 2, s.PUSH, lag=1)}
    return {
        "default": None,
        "sm_copy(split(bidirectional, 2))": s.with_mechanism(
            s.split(s.bidirectional(world), 2), s.SM_COPY
        ),
    }


class Case:
    """One call of an example on fresh random inputs: ``call(out)``, and ``check(out)``
    against float64 (collectives: every rank makes them, in the same order)."""

    def __init__(self, name: str, dist, rank: int, world: int, device, dtype, sizes):
        import examples.ag_rmsnorm_gemm as b
        import examples.ag_swiglu as a
        import examples.gemm_rs_bias as c
        from overlap_kernels import reference as ref

        m, k, n = sizes  # gather: m rows per rank; reduce: m rows of the product
        new = {"dtype": dtype, "device": device}
        x = torch.randn(m, k, **new)
        self.name, self.x, self.dtype = name, x, dtype
        if name == "ag_swiglu":
            w_gate, w_up = (torch.randn(k, n, **new) / k**0.5 for _ in range(2))
            self.op, self.operands, self.n = a.AG_SWIGLU, (w_gate, w_up), n
            self.judge = lambda out: ref.judge_swiglu_matmul(out, _gather(dist, x), w_gate, w_up)
        elif name == "ag_rmsnorm_gemm":
            gain = (0.5 + torch.rand(k, device=device)).to(dtype)
            w = torch.randn(k, n, **new) / k**0.5
            self.op, self.operands, self.n = b.AG_RMSNORM_GEMM, (gain, w, EPS), n
            self.judge = lambda out: ref.judge_normed_matmul(out, _gather(dist, x), gain, EPS, w)
        else:
            w = torch.randn(k, n, **new) / k**0.5
            bias = torch.randn(n, **new)
            own = _rows(rank, m, world)
            residual = torch.randn(own.stop - own.start, n, **new)
            self.op, self.operands, self.n = c.GEMM_RS_BIAS, (w, bias, residual), n

            def judge(out):
                xs, ws = _gather(dist, x[None]), _gather(dist, w[None])
                xs_own = [xr[own] for xr in xs]  # (x_r @ w_r)[own] = x_r[own] @ w_r
                return ref.judge_reduced_matmul(out, xs_own, list(ws), (bias[None, :], residual))

            self.judge = judge
        rows = m * world if self.op.kind == "gather" else own.stop - own.start
        self.out_shape = (rows, n)

    def renew(self) -> None:
        """New random values in the same tensors (as a captured graph's inputs are refilled)."""
        for t in (self.x, *self.operands):
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                t.copy_(torch.randn_like(t) / (t.shape[0] ** 0.5 if t is not self.x else 1))

    def check(self, out: torch.Tensor, what: str) -> float:
        verdict = self.judge(out)
        assert verdict.problem is None, f"{self.name} {what}: {verdict.problem}"
        return verdict.error


def _sizes(name: str, use_gpu: bool) -> tuple[int, int, int]:
    """(m, K, N): m not a multiple of the 16-row blocks (gather: per rank; reduce: the
    product's, uneven over 2 and 4 ranks), N not a multiple of the 16 columns;
    rows of 16-byte multiples (the examples read them by TMA descriptors)."""
    if use_gpu:
        return (200, 256, 328) if name != "gemm_rs_bias" else (410, 256, 328)
    return (5, 32, 40) if name != "gemm_rs_bias" else (13, 32, 40)


_BLOCKS = {"block_m": 16, "block_n": 16, "timeout_s": 20.0}  # several tiles per chunk on CPU


def _cases(names, world: int) -> list[tuple[str, str, object]]:
    """(example, schedule's label, schedule): one rank takes the default schedule only."""
    return [(name, label, schedule) for name in names
            for label, schedule in _schedules(name, world).items()
            if world > 1 or schedule is None]  # fmt: skip


def examples_body(rank, world, use_gpu, names, dtypes):
    """Every example and schedule in every dtype (on 2 and 3 CPU ranks: in their share of
    the dtypes, ranks.runs_here), twice each (both buffer halves)."""
    import overlap_kernels as ok
    from overlap_kernels.reference import poisoned

    dist, device = setup_rank(rank, use_gpu)
    config = None if use_gpu else _BLOCKS
    errors = {}
    for c, (name, label, schedule) in enumerate(_cases(names, world)):
        for d, dtype in enumerate(dtypes):
            if runs_here(world, use_gpu, c, d):
                for call in range(2):
                    case = Case(name, dist, rank, world, device, dtype, _sizes(name, use_gpu))
                    out = poisoned(case.out_shape, dtype, device)
                    result = case.op(case.x, *case.operands, n=case.n, schedule=schedule,
                                     config=config, out=out)  # fmt: skip
                    ok.raise_if_failed()  # a timeout is the error to report, not the numbers
                    assert result is out
                    errors[(name, str(dtype), label, call)] = case.check(out, f"{dtype} {label}")
    return errors


@pytest.mark.parametrize("world", [1, *CPU_SHARED_WORLDS])
def test_examples_against_float64_cpu(world):
    errors = run_ranks(examples_body, world, False, EXAMPLES, DTYPES, timeout_s=900)
    runs = runs_on_cpu(world, len(_cases(EXAMPLES, world)), len(DTYPES))
    assert all(len(e) == 2 * runs for e in errors), "a case did not run"  # (2 calls each)


def alone_body(rank, world, use_gpu):
    """One rank, a gather example: on x where TMA can read it, the kernel alone (its
    copy, announcement and transfer made to raise); on x at an unaligned address,
    x copied into the gathered buffer as on more ranks. Both right."""
    from unittest import mock

    from overlap_kernels.ops.custom_details import gather

    def refused(*args, **kwargs):
        raise AssertionError("x copied, announced or moved on one rank")

    dist, device = setup_rank(rank, use_gpu)
    config = None if use_gpu else _BLOCKS
    checked = 0
    for name in ("ag_swiglu", "ag_rmsnorm_gemm"):
        case = Case(name, dist, rank, world, device, torch.float32, _sizes(name, use_gpu))
        with mock.patch.multiple(gather, publish=refused, announce=refused, transfer=refused):
            case.check(case.op(case.x, *case.operands, n=case.n, config=config), "in place")
        storage = torch.empty(case.x.numel() + 1, dtype=case.x.dtype, device=device)
        unaligned = storage[1:].view_as(case.x).copy_(case.x)  # 4 bytes past 16
        out = case.op(unaligned, *case.operands, n=case.n, config=config)
        case.check(out, "unaligned x")
        checked += 2
    return checked


def test_one_rank_gather_reads_x_in_place_cpu():
    assert run_ranks(alone_body, 1, False, timeout_s=600) == [4]


def replay_body(rank, world, use_gpu, names, dtypes, replays):
    """Each example called eagerly, then replayed ``replays`` times with new inputs
    in the same tensors, every result checked: on GPUs a captured CUDA graph; on
    the CPU the replay's steps run as a graph replays them (the device epoch,
    and for gather ops the entry)."""
    import overlap_kernels as ok
    from overlap_kernels.ops import plans
    from overlap_kernels.reference import poisoned

    dist, device = setup_rank(rank, use_gpu)
    config = None if use_gpu else _BLOCKS
    checked = 0
    for name in names:
        for dtype in dtypes:
            case = Case(name, dist, rank, world, device, dtype, _sizes(name, use_gpu))
            out = poisoned(case.out_shape, dtype, device)
            case.op(case.x, *case.operands, n=case.n, config=config, out=out)
            case.check(out, "eager")
            plan = plans.cached(
                case.op._signature(case.x, case.operands, case.n, None, None, config)
            )
            if use_gpu:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    case.op(case.x, *case.operands, n=case.n, config=config, out=out)
                replay = graph.replay
            else:  # what CUDA's eager call and capture do
                plan.prepare_replay(case.x, case.operands, out)
                counted = plan.replay_state.ws.chunk_flags[REPLAY_EPOCH_SLOT].item()
                replay = lambda plan=plan, case=case, out=out: plan.replay(
                    case.x, case.operands, out
                )  # noqa: E731
            for i in range(replays):
                case.renew()
                out.fill_(float("nan"))
                replay()
                ok.raise_if_failed()
                case.check(out, f"{dtype} replay {i}")
                checked += 1
            if (
                not use_gpu
            ):  # each replay counted its epochs on the device (a gather op's entry too)
                per_call = 1 if case.op.kind == "reduce" else 2
                now = plan.replay_state.ws.chunk_flags[REPLAY_EPOCH_SLOT].item()
                assert now == counted + per_call * replays, (name, counted, now)
            # Eager calls after the replays still run (their own workspace and epochs).
            case.renew()
            case.check(case.op(case.x, *case.operands, n=case.n, config=config), "eager after")
    dist.barrier()
    ok.reset_workspaces()
    return checked


@pytest.mark.parametrize("world", [1, 2])
def test_examples_replay_as_captured_cpu(world):
    got = run_ranks(replay_body, world, False, EXAMPLES, (torch.float32,), 2, timeout_s=900)
    assert got == [6] * world


@gpu_ranks(worlds=(2, 4), backends=("torch",))
def test_examples_eager_and_in_cuda_graphs_gpu(world, gpus, backend):
    """bf16 and fp32, 20 replays each, on ranks sharing one GPU (or one each)."""
    run_on_gpus(examples_body, world, gpus, backend, EXAMPLES, DTYPES, timeout_s=600)
    replayed = run_on_gpus(replay_body, world, gpus, backend, EXAMPLES, DTYPES, 20, timeout_s=600)
    assert replayed == [len(EXAMPLES) * len(DTYPES) * 20] * world
