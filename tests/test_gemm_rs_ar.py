"""gemm_rs and gemm_ar on 1-4 rank processes: CPU (gloo, host backend, Triton's
interpreter) and, behind the ``gpu`` marker, CUDA GPUs (NCCL, symmetric memory).

Spawning ranks costs ~3 s, so each test spawns once per world size and runs
many checks inside; the interpreter is slow, so the CPU shapes are tiny (but
ragged: M, N and the row slices are not multiples of the 16 x 32 tiles).
Results are judged against fp64 with a bound taken from the sequential path
in the same dtype (``judge_sum`` says why), outputs poisoned with NaN first.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, runs_here, runs_on_cpu, setup_rank

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import _FLOOR, _UNIT_ROUNDOFF, check_matmul, poisoned, relative_error

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _gather(dist, t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _rows(rank: int, m: int, world: int) -> slice:
    return slice(rank * m // world, (rank + 1) * m // world)


# ---- the oracle -------------------------------------------------------------


def judge_sum(out, xs, ws, sequential, rows=slice(None), scale=1.0) -> tuple[float, str | None]:
    """Judge ``out`` == scale * (sum_r xs[r] @ ws[r])[rows] against fp64: (error, problem).

    reference.judge_matmul bounds one product by twice the error of the plain
    product in the same dtype. A sum over ranks has no single plain product:
    every method moves each rank's partial in the output dtype, so rounds it
    before the sum (and NCCL / gloo round again after every add). The yardstick
    is therefore ``sequential``, the result of the op's own sequential path in
    the same dtype (torch.matmul on every rank, then the collective:
    :func:`sequential_sum`); the fused paths sum the rounded partials in fp32,
    so they are at least as accurate. Two checks, as in judge_matmul:
    - the relative error may be at most twice the sequential path's, plus the
      floor judge_matmul uses (rounding-level results);
    - element by element, so that one wrong element cannot hide in the norm,
      it may differ from fp64 by twice the sum of: the sequential path's own
      error there, the output's rounding, every partial's rounding, and the
      fp32 bound on summing all K_local * world products.
    """
    dtype, k_total = out.dtype, sum(x.shape[1] for x in xs)
    a = [x[rows] for x in xs]
    reference = scale * sum(x.double() @ w.double() for x, w in zip(a, ws))
    if tuple(out.shape) != tuple(reference.shape):
        return float("inf"), f"shape {tuple(out.shape)}, expected {tuple(reference.shape)}"
    if out.isnan().any():
        return float("nan"), "NaN in the output (an unwritten tile?)"
    error = relative_error(out, reference)
    allowed = 2 * relative_error(sequential, reference) + _FLOOR[dtype]
    if error > allowed:
        return error, f"relative error {error:.3g} > allowed {allowed:.3g}"
    u = _UNIT_ROUNDOFF[dtype]
    travel = sum((x.float() @ w.float()).to(dtype).double().abs() for x, w in zip(a, ws))
    magnitude = sum(x.double().abs() @ w.double().abs() for x, w in zip(a, ws))
    plain = (sequential.double() - reference).abs() + u * reference.abs()
    per_element = 2 * (plain + scale * (u * travel + k_total * 2.0**-24 * magnitude))
    excess = (out.double() - reference).abs() - per_element
    if excess.numel() and excess.max() > 0:
        row, col = divmod(int(excess.argmax()), reference.shape[1])
        return (
            error,
            f"element [{row}, {col}] is {out[row, col].item()}, reference {reference[row, col].item()}",
        )
    return error, None


def sequential_sum(dist, x, w, scale=1.0) -> torch.Tensor:
    """The [M, N] sum by the sequential path, in x's dtype: torch.matmul, then
    the collective (gloo or NCCL; "avg" divides the rounded sum)."""
    total = torch.matmul(x, w)
    dist.all_reduce(total)
    return total if scale == 1.0 else total.div_(round(1 / scale))


def check_sum(dist, out, x, w, rows=slice(None), scale=1.0, what="") -> float:
    """Collective: every rank checks its ``out`` (rows ``rows`` of the sum)."""
    xs, ws = _gather(dist, x), _gather(dist, w)
    sequential = sequential_sum(dist, x, w, scale)[rows]
    error, problem = judge_sum(out, xs, ws, sequential, rows, scale)
    assert problem is None, f"{what}: {problem}"
    return error


def check_op(dist, op: str, out, x, w, what: str) -> None:
    """Collective: ``out`` of ``op`` (ag_gemm, gemm_rs or gemm_ar) called with x, w on every rank."""
    if op == "ag_gemm":
        check_matmul(out, torch.cat(_gather(dist, x)), w, what)
        return
    rows = (
        _rows(dist.get_rank(), x.shape[0], dist.get_world_size())
        if op == "gemm_rs"
        else slice(None)
    )
    check_sum(dist, out, x, w, rows, what=what)


def test_oracle_rejects_wrong_sums():
    """The oracle can fail: a missing partial, one wrong element, an unwritten
    tile, a wrong row slice, avg not applied; it accepts correct sums."""
    torch.manual_seed(int(time.time_ns() % 2**31))
    for dtype in DTYPES:
        xs = [torch.randn(23, 32, dtype=dtype) for _ in range(3)]
        ws = [torch.randn(32, 40, dtype=dtype) for _ in range(3)]
        partials = [(x.float() @ w.float()).to(dtype) for x, w in zip(xs, ws)]
        seq = ((partials[0] + partials[1]) + partials[2]).to(
            dtype
        )  # as a collective adds, in the dtype
        good = sum(p.float() for p in partials).to(dtype)  # as the fused kernels add, in fp32
        assert judge_sum(good, xs, ws, seq)[1] is None
        assert judge_sum(seq, xs, ws, seq)[1] is None
        avg = (sum(p.float() for p in partials) / 3).to(dtype)
        assert judge_sum(avg, xs, ws, seq / 3, scale=1 / 3)[1] is None
        assert judge_sum(good, xs, ws, seq / 3, scale=1 / 3)[1] is not None  # "avg" not applied
        assert "relative error" in judge_sum(sum(partials[:2]).to(dtype), xs, ws, seq)[1]
        # One element off by 4x the rounding it may carry: too little to move the
        # norm in bf16, caught element by element.
        u, travel = _UNIT_ROUNDOFF[dtype], sum(p.double().abs() for p in partials)
        magnitude = sum(x.double().abs() @ w.double().abs() for x, w in zip(xs, ws))
        reference = sum(x.double() @ w.double() for x, w in zip(xs, ws))
        slack = (
            (seq.double() - reference).abs()
            + u * (reference.abs() + travel)
            + 96 * 2.0**-24 * magnitude
        )
        wrong = good.clone()
        wrong[7, 33] = (reference[7, 33] + 4 * slack[7, 33]).to(dtype)
        problem = judge_sum(wrong, xs, ws, seq)[1]
        assert problem is not None and (dtype != torch.bfloat16 or "element [7, 33]" in problem), (
            problem
        )
        holes = good.clone()
        holes[16:, 32:] = float("nan")
        assert "NaN" in judge_sum(holes, xs, ws, seq)[1]
        assert judge_sum(good[8:15], xs, ws, seq[8:15], slice(8, 15))[1] is None
        assert judge_sum(good[7:14], xs, ws, seq[8:15], slice(8, 15))[1] is not None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # what gloo gathers of any dtype; equal bytes, equal bits


# ---- schedules a user builds by hand -----------------------------------------


def _by_hand(world: int, order, mechanism_of=lambda i: "push", name: str = "by hand"):
    """``order(rank)`` lists (owner, piece) with pieces 2; remote chunks get
    ``mechanism_of(position)`` and a flag each, own chunks are reductions."""
    from overlap_kernels.schedules import LOCAL, Chunk, ChunkSchedule

    lists = []
    for rank in range(world):
        flags = itertools.count()
        lists.append(tuple(
            Chunk(o, i, 2, LOCAL) if o == rank else Chunk(o, i, 2, mechanism_of(j), next(flags))
            for j, (o, i) in enumerate(order(rank))
        ))  # fmt: skip
    return ChunkSchedule(world, tuple(lists), name)


def _descending(world: int, mechanism_of=lambda i: "push"):
    """Peers from the nearest lower rank down, piece 1 before piece 0, own pieces
    last in reverse: not what rounds() makes, still valid."""

    def order(rank):
        peers = [(rank - d) % world for d in range(1, world)]
        return [(p, i) for i in (1, 0) for p in peers] + [(rank, 1), (rank, 0)]

    return _by_hand(world, order, mechanism_of, "descending")


def _eager(world: int):
    """Each own piece reduced right after pushing that piece of every peer."""
    return _by_hand(
        world,
        lambda r: [(p, i) for i in (0, 1) for p in [*range(r + 1, world), *range(r)] + [r]],
        name="eager",
    )


def _own_first(world: int):
    """Every rank reduces its own piece 0 first: every rank waits for peers that wait."""
    rounds = [(p, i) for i in (0, 1) for p in range(world)]
    return _by_hand(
        world, lambda r: [(r, 0)] + [c for c in rounds if c != (r, 0)], name="own first"
    )


# ---- correctness --------------------------------------------------------------


def _sizes(use_gpu: bool):
    # (M, K_local, N): M not a multiple of BLOCK_M (16 on CPU, 128 on GPUs) and,
    # but for 1000, of no world size (uneven slices); N not a multiple of BLOCK_N (32 / 256).
    return [(1000, 512, 1000), (333, 256, 520)] if use_gpu else [(23, 64, 40), (37, 32, 72)]


def _decode_sizes(use_gpu: bool):
    return [(1, 512, 1000), (16, 512, 1000)] if use_gpu else [(1, 64, 40), (16, 32, 72)]


def _decode_variants(world: int):
    """(name, op, config, extra kwargs) at decode sizes: one_shot (its operands read by TMA
    and by pointer loads) where there are peers, and what auto takes."""
    one_shot = {"path": "one_shot"}
    pairs = (
        [("ar one_shot", "gemm_ar", one_shot, {}),
         ("ar one_shot pointer loads", "gemm_ar", {**one_shot, "loads": "pointer"}, {})]
        if world > 1
        else []
    )  # fmt: skip
    return pairs + [("ar auto", "gemm_ar", {}, {}), ("rs auto", "gemm_rs", {}, {})]


def _variants(world: int, use_gpu: bool):
    """(name, op, config, extra kwargs): every path and mechanism; world 1 has
    only the sequential path (the fused one has nothing to reduce)."""
    from overlap_kernels.schedules import COPY_ENGINE

    if world == 1:
        return [
            ("rs auto", "gemm_rs", {}, {}),
            ("rs sequential avg", "gemm_rs", {"path": "sequential"}, {"reduce_op": "avg"}),
            ("ar auto", "gemm_ar", {}, {}),
        ]
    fused = {
        "path": "fused",
        "mechanism": "push",
        "timeout_s": 20.0,
    }  # a lost signal fails in 20 s, not 30
    copy_engine = {**fused, "mechanism": COPY_ENGINE, "comm_sms": 2}
    two_shot = {"path": "two_shot", "mechanism": "push", "comm_sms": 2, "timeout_s": 20.0}
    pulled = _descending(world, lambda j: COPY_ENGINE)
    return [
        ("rs push", "gemm_rs", {**fused, "pieces": 1}, {}),
        ("rs push pieces 2 avg", "gemm_rs", {**fused, "pieces": 2}, {"reduce_op": "avg"}),
        ("rs push pieces 2 lag 1", "gemm_rs", {**fused, "pieces": 2, "lag": 1}, {}),
        ("rs copy_engine avg", "gemm_rs", {**copy_engine, "pieces": 1}, {"reduce_op": "avg"}),
        ("rs copy_engine pieces 2", "gemm_rs", {**copy_engine, "pieces": 2}, {}),
        (
            "rs cublas producer avg",
            "gemm_rs",
            {**copy_engine, "producer": "cublas"},
            {"reduce_op": "avg"},
        ),
        (
            "rs cublas producer pieces 2 tma",
            "gemm_rs",
            {**copy_engine, "producer": "cublas", "pieces": 2, "epilogue": "tma"},
            {},
        ),
        (
            "rs push cublas producer avg",
            "gemm_rs",
            {**fused, "producer": "cublas"},
            {"reduce_op": "avg"},
        ),
        (
            "rs push cublas producer pieces 2 tma",
            "gemm_rs",
            {**fused, "producer": "cublas", "pieces": 2, "epilogue": "tma"},
            {},
        ),
        ("rs sequential avg", "gemm_rs", {"path": "sequential"}, {"reduce_op": "avg"}),
        ("rs user descending", "gemm_rs", fused, {"schedule": _descending(world)}),
        ("rs user eager", "gemm_rs", fused, {"schedule": _eager(world), "reduce_op": "avg"}),
        ("rs user copy_engine", "gemm_rs", {**fused, "comm_sms": 2}, {"schedule": pulled}),
        (
            "rs user copy_engine cublas",
            "gemm_rs",
            {**copy_engine, "producer": "cublas"},
            {"schedule": pulled},
        ),
        (
            "rs user push cublas",
            "gemm_rs",
            {**fused, "producer": "cublas"},
            {"schedule": _descending(world)},
        ),
        ("rs push tma epilogue", "gemm_rs", {**fused, "pieces": 2, "epilogue": "tma"}, {}),
        ("ar one_shot", "gemm_ar", {"path": "one_shot"}, {}),
        ("ar one_shot tma epilogue", "gemm_ar", {"path": "one_shot", "epilogue": "tma"}, {}),
        ("ar two_shot tma epilogue", "gemm_ar", {**two_shot, "pieces": 2, "epilogue": "tma"}, {}),
        ("ar two_shot pieces 1", "gemm_ar", {**two_shot, "pieces": 1, "lag": 1}, {}),
        ("ar two_shot pieces 2", "gemm_ar", {**two_shot, "pieces": 2, "lag": 1}, {}),
        ("ar two_shot user eager", "gemm_ar", two_shot, {"schedule": _eager(world)}),
        # The template's lag (1) is for pushed partials: pulled ones ignore it.
        (
            "ar two_shot copy_engine",
            "gemm_ar",
            {**two_shot, "mechanism": COPY_ENGINE, "pieces": 2},
            {},
        ),
        (
            "ar two_shot copy_engine pieces 1 tma",
            "gemm_ar",
            {**two_shot, "mechanism": COPY_ENGINE, "lag": None, "pieces": 1, "epilogue": "tma"},
            {},
        ),
        (
            "ar two_shot user copy_engine",
            "gemm_ar",
            {**two_shot, "mechanism": COPY_ENGINE, "lag": None},
            {"schedule": pulled},
        ),
        (
            "ar two_shot push cublas producer",
            "gemm_ar",
            {**two_shot, "producer": "cublas", "lag": None, "pieces": 1},
            {},
        ),
        (
            "ar two_shot push cublas producer pieces 2 tma",
            "gemm_ar",
            {**two_shot, "producer": "cublas", "lag": None, "pieces": 2, "epilogue": "tma"},
            {},
        ),
        (
            "ar two_shot user push cublas",
            "gemm_ar",
            {**two_shot, "producer": "cublas", "lag": None},
            {"schedule": _descending(world)},
        ),
        ("ar sequential", "gemm_ar", {"path": "sequential"}, {}),
    ]


def _call(ok, name, op, x, w, config, kwargs, rank, world, device):
    """One call into a poisoned ``out``; returns (out, rows of the sum it holds, scale)."""
    m, n = x.shape[0], w.shape[1]
    rows = _rows(rank, m, world) if op == "gemm_rs" else slice(0, m)
    out = poisoned((rows.stop - rows.start, n), x.dtype, device)
    result = getattr(ok, op)(x, w, config=config, out=out, **kwargs)
    ok.raise_if_failed()  # a timeout is the error to report, not the numbers after it
    assert result is out, f"{name}: did not return out"
    scale = 1 / world if kwargs.get("reduce_op") == "avg" else 1.0
    return out, rows, scale


def correctness_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    errors, fused_calls = {}, 0
    cases = [(v, s, False) for v in _variants(world, use_gpu) for s in _sizes(use_gpu)]
    cases += [(v, s, True) for v in _decode_variants(world) for s in _decode_sizes(use_gpu)]
    for d, dtype in enumerate(DTYPES):
        for c, ((name, op, config, kwargs), (m, k, n), is_decode) in enumerate(cases):
            if not runs_here(world, use_gpu, c, d):
                continue
            x = torch.randn(m, k, dtype=dtype, device=device)
            weight = torch.randn(n, k, dtype=dtype, device=device)  # nn.Linear layout [N, K_local]
            w = (
                weight.t() if (c + d) % 2 else weight.t().contiguous()
            )  # both layouts for every variant
            out, rows, scale = _call(ok, name, op, x, w, config, kwargs, rank, world, device)
            # Fused unless asked otherwise, or auto where it resolves to the plain
            # path (tiny problems on GPUs), or gemm_rs with a rank owning no rows.
            path = config.get("path", "auto")
            if path == "auto":
                path = getattr(ok.ops, op).running_config(x, w, None, config or None).path
            fused = world > 1 and path != "sequential" and (op == "gemm_ar" or m >= world)
            what = f"{name} {dtype} M={m} N={n} w{'.t()' if (c + d) % 2 else ''}"
            if op == "gemm_ar" and fused:  # every rank holds the same bits
                for r, other in enumerate(_gather(dist, _bits(out))):
                    assert torch.equal(other, _bits(out)), (
                        f"{what}: rank {r} differs from rank {rank}"
                    )
            errors[(what, is_decode)] = check_sum(dist, out, x, w, rows, scale, what)
            if world == 1 and scale == 1.0:  # one rank: the sum is one plain product
                check_matmul(out, x, w, what)
            fused_calls += fused
    # The fused kernels ran (auto did not quietly take the sequential path).
    assert world == 1 or get_workspace(None, device).epoch == fused_calls
    return errors


CPU_WORLDS = [1, *CPU_SHARED_WORLDS]


@pytest.mark.parametrize("world", CPU_WORLDS)
def test_correct_every_path_dtype_and_ragged_shape_cpu(world):
    errors = run_ranks(correctness_body, world, False)
    cases = len(_variants(world, False)) * len(_sizes(False)) + len(_decode_variants(world)) * len(
        _decode_sizes(False)
    )
    assert all(len(e) == runs_on_cpu(world, cases, len(DTYPES)) for e in errors), (
        "a case did not run"
    )


def cublas_products_body(rank, world, use_gpu):
    """The cuBLAS producer's matmuls: pushed partials are one product per owner
    (its whole segment, straight into this rank's slot there, every piece's
    flag set after it), in the order of the owners' first pieces in the
    schedule (no piece is empty here); pulled ones are one product per piece
    (each announced as it is staged, for its pull to start)."""
    import overlap_kernels as ok
    from overlap_kernels.ops.reduce_details.plan import build_two_shot, segment
    from overlap_kernels.runtime.workspace import get_workspace
    from overlap_kernels.schedules import COPY_ENGINE, PUSH
    from overlap_kernels.schedules.producers import rounds

    dist, device = setup_rank(rank, use_gpu)
    m, n, pieces = 24, 40, 3
    x, w = torch.randn(m, 32, device=device), torch.randn(32, n, device=device)
    pushed = {
        "path": "two_shot",
        "mechanism": PUSH,
        "producer": "cublas",
        "lag": None,
        "pieces": pieces,
    }
    check_sum(
        dist, ok.gemm_ar(x, w, config=pushed), x, w, what="gemm_ar pushed by cuBLAS"
    )  # reserves the workspace
    ws = get_workspace(None, device)
    cfg = ok.ops.gemm_ar.running_config(x, w, None, pushed)
    plan = build_two_shot(ws, rounds(world, pieces, PUSH), m, n, x.dtype, cfg, 0, publish=True)
    owners = [(rank + distance) % world for distance in range(1, world)]
    assert [p.rows for p in plan.staged] == [segment(o, m, world) for o in owners]
    assert [len(set(p.flags)) for p in plan.staged] == [pieces] * (world - 1)
    slot = ws.data(owners[0], 0, (world, -(-m // world), n), x.dtype)[rank]
    assert plan.staged[0].dst.data_ptr() == slot.data_ptr(), "not this rank's slot at the owner"
    assert 0 < plan.gemm_start == plan.num_producer_tiles, (
        "our GEMM must start past the cuBLAS pieces"
    )
    pulled = {
        "path": "fused",
        "mechanism": COPY_ENGINE,
        "producer": "cublas",
        "comm_sms": 1,
        "pieces": pieces,
    }
    cfg = ok.ops.gemm_rs.running_config(x, w, None, pulled)
    plan = build_two_shot(
        ws, rounds(world, pieces, COPY_ENGINE), m, n, x.dtype, cfg, 0, publish=False
    )
    assert [len(p.flags) for p in plan.staged] == [1] * pieces * (world - 1)
    assert sum(p.rows[1] - p.rows[0] for p in plan.staged) == m - (m // world)
    return len(plan.staged)


def test_cublas_producer_products_cpu():
    assert run_ranks(cublas_products_body, 3, False) == [6] * 3


# ---- a late rank, and calls back to back ---------------------------------------


class _SlowAfterGemm:
    """Wraps the producer GEMM's launch: after it this rank sleeps, so its
    pulls, reductions and gathers run late while peers, which got its partials
    and published sums, go on to their next call (into the other buffer half)."""

    def __init__(self, launch, seconds: float):
        self.launch, self.seconds = launch, seconds

    def __call__(self, *args, **kwargs):
        self.launch(*args, **kwargs)
        time.sleep(self.seconds)


_PULL = {"path": "fused", "mechanism": "copy_engine", "comm_sms": 2}
# Each call's copies after its GEMM (late on rank 1) race with its peers' next
# call. Pulled calls set their own flags late, which a peer's next call may
# have set already for its own call (the flag-clobber bug of the report, see
# test_late_pull_signal_then_push_cpu); so a pulled call is followed only by
# calls whose peers signal other slots: a pulled call of the same pieces, or ag_gemm.
_CYCLE = [
    (
        "gemm_ar",
        {"path": "two_shot", "mechanism": "push", "pieces": 2, "lag": 1},
    ),  # gathers peers' published rows late
    ("gemm_rs", {"path": "fused", "mechanism": "push"}),  # pushes into peers' slots at once
    ("gemm_ar", {"path": "one_shot"}),
    ("gemm_ar", {"path": "two_shot", "mechanism": "push", "pieces": 1}),
    ("gemm_rs", {**_PULL, "pieces": 2}),  # stages into its own rows at once, pulls peers' late
    ("gemm_ar", {**_PULL, "path": "two_shot", "pieces": 2}),  # pulls, then gathers late
    ("ag_gemm", {"path": "fused", "gemm": "triton"}),  # shares the workspace
    ("gemm_rs", {"path": "fused", "mechanism": "push", "pieces": 2, "lag": 1}),
]


def _back_to_back_calls(world: int):
    """(op, M, K, N, dtype, config) for 25 calls: ops, paths, mechanisms, pieces,
    shapes and dtypes change every call; call 12 needs more than the initial
    1 MiB: the workspace grows."""
    calls = []
    # M >= 2 * world: every rank's rows cut into 2 pieces, none of them empty.
    shapes = [
        (23, 64, 40),
        (2 * world, 32, 32),
        (37, 32, 72),
        (16, 64, 40),
        (5 * world + 1, 32, 96),
    ]
    for i in range(25):
        m, k, n = shapes[(3 * i) % len(shapes)]
        op, config = _CYCLE[i % len(_CYCLE)]
        m = max(1, m // world) if op == "ag_gemm" else m  # ag_gemm takes this rank's rows
        calls.append((op, m, k, n, DTYPES[i % 2], config))
    # one_shot fp32 [256, 512] x world slots: > 1 MiB in each buffer half
    # (in place of the first of two pulled calls: what precedes it sets no flag late).
    calls[12] = (
        "gemm_ar",
        256,
        32,
        512,
        torch.float32,
        {"path": "one_shot", "block_m": 128, "block_n": 256},
    )
    return calls


def delayed_and_back_to_back_body(rank, world, use_gpu):
    import overlap_kernels as ok
    import overlap_kernels.ops.reduce_details.run as run_step
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16
    # 1. One rank enters each op ~1 s after its peers, who wait for its
    # partials (gemm_rs), tiles (one_shot) or published sums (two_shot).
    late = [("gemm_rs", {"path": "fused", "mechanism": "push", "pieces": 2}), ("gemm_ar", {"path": "one_shot"}),
            ("gemm_ar", {"path": "two_shot", "mechanism": "push"}), ("gemm_rs", {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1}),
            ("gemm_rs", {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1, "producer": "cublas"}),
            ("gemm_rs", {"path": "fused", "mechanism": "push", "producer": "cublas"}),
            ("gemm_ar", {"path": "two_shot", "mechanism": "push", "producer": "cublas", "lag": None, "pieces": 2}),
            ("gemm_ar", {"path": "two_shot", "mechanism": "copy_engine", "pieces": 2})]  # fmt: skip
    for i, (op, config) in enumerate(late):
        x = torch.randn(21, 32, dtype=dtype, device=device)
        w = torch.randn(32, 40, dtype=dtype, device=device)
        if rank == (world - 1 - i) % world:
            time.sleep(1.0)
        out = getattr(ok, op)(x, w, config=config)
        rows = _rows(rank, 21, world) if op == "gemm_rs" else slice(None)
        check_sum(dist, out, x, w, rows, what=f"late rank, {op} {config}")
    ws = get_workspace(None, device)
    first_epoch, capacity = ws.epoch, ws.data_capacity
    # 2. Calls back to back, checked only after the last (no collective in
    # between lines the ranks up); rank 1 finishes every call with copies after
    # its GEMM 0.5 s late, so its peers start the next call while it still reads.
    launch = run_step.launch_reduce_gemm
    done = []
    for i, (op, m, k, n, dt, config) in enumerate(_back_to_back_calls(world)):
        copies_after_gemm = (
            config.get("path") == "two_shot" or config.get("mechanism") == "copy_engine"
        )
        if rank == 1 and copies_after_gemm and not use_gpu:
            run_step.launch_reduce_gemm = _SlowAfterGemm(launch, 0.5)
        x = torch.randn(m, k, dtype=dt, device=device)
        weight = torch.randn(n, k, dtype=dt, device=device)
        w = weight.t() if i % 2 else weight.t().contiguous()
        out = getattr(ok, op)(x, w, config=config)
        run_step.launch_reduce_gemm = launch
        done.append((op, x, w, out))
    ok.raise_if_failed()
    for i, (op, x, w, out) in enumerate(done):
        check_op(dist, op, out, x, w, f"call {i} ({op} {tuple(x.shape)} {x.dtype})")
    assert get_workspace(None, device) is ws and ws.data_capacity > capacity, (
        "call 12 did not grow the workspace"
    )
    return ws.epoch - first_epoch


# Three ranks (a delayed rank among two peers); two are the GPU variant's.
@pytest.mark.parametrize("world", [3])
def test_delayed_rank_and_25_calls_cpu(world):
    assert run_ranks(delayed_and_back_to_back_body, world, False) == [25] * world


def late_pull_signal_body(rank, world, use_gpu):
    """A pulled gemm_rs whose owner-side flag, set after it pulls a peer's
    partial, lands late on rank 1 (a slow communication stream), then a pushed
    gemm_rs, in which rank 0 signals the same flag slot for the next call."""
    import overlap_kernels as ok
    from overlap_kernels.runtime.workspace import Workspace

    dist, device = setup_rank(rank, use_gpu)
    if rank == 1:
        signal = Workspace.signal_from_stream

        def late(self, slot, epoch):
            time.sleep(1.0)
            signal(self, slot, epoch)

        Workspace.signal_from_stream = late
    x = torch.randn(8, 32, device=device)
    w = torch.randn(32, 32, device=device)
    outs = [ok.gemm_rs(x, w, config={"path": "fused", "timeout_s": 3.0, **c})
            for c in ({"mechanism": "copy_engine", "comm_sms": 1}, {"mechanism": "push"})]  # fmt: skip
    for out in outs:
        check_sum(dist, out, x, w, _rows(rank, 8, world))


def test_late_pull_signal_then_push_cpu():
    """A pull's flag is set by the owner's own stream; a peer's push signals in
    the next call. The late, older stream write must not take the peer's newer
    signal away (they use separate flag ranges: limits.py)."""
    run_ranks(late_pull_signal_body, 2, False)


def edge_call_body(rank, world, use_gpu, op, m, config):
    """One call at an edge of the pieces: "right" (its sum, into a poisoned out,
    checked against fp64) or the message it was refused with."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(m, 32, device=device)
    w = torch.randn(32, 32, device=device)
    rows = _rows(rank, m, world) if op == "gemm_rs" else slice(None)
    out = poisoned((len(range(m)[rows]), 32), x.dtype, device)
    try:
        result = getattr(ok, op)(x, w, config={**config, "timeout_s": 3.0}, out=out)
    except ok.OverlapInputError as e:
        return str(e)
    check_sum(dist, result, x, w, rows, what=op)
    return "right"


@pytest.mark.parametrize("op, m, config, expected", [
    # A rank's rows are fewer than the pieces: an empty piece has no tiles and no
    # signal, so nothing may wait for it (its gather or pull), and the sum is right.
    ("gemm_ar", 2, {"path": "two_shot", "pieces": 2}, "right"),
    ("gemm_rs", 2, {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1, "pieces": 2}, "right"),
    # rounds(pieces=3, lag=1) does not put own pieces last, which pulls need:
    # the config is refused, naming the knob (a user schedule so is too: reduce_details/knobs.py).
    ("gemm_rs", 24, {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1, "pieces": 3, "lag": 1},
     "gemm_rs: config: copy_engine pulls need every rank's own pieces last: lag None or >= pieces, got lag 1"),
], ids=["two_shot_empty_piece", "copy_engine_empty_piece", "copy_engine_lag_1"])  # fmt: skip
def test_edge_calls_are_right_or_refused_as_documented_cpu(op, m, config, expected):
    assert run_ranks(edge_call_body, 2, False, op, m, config) == [expected] * 2


# ---- a rank that never calls ----------------------------------------------------

TIMEOUT_CASES = [
    ("gemm_rs", {"path": "fused", "mechanism": "push"}),
    ("gemm_rs", {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1}),
    ("gemm_ar", {"path": "one_shot"}),
    ("gemm_ar", {"path": "two_shot", "mechanism": "push", "pieces": 1}),
    ("gemm_ar", {"path": "two_shot", "pieces": 1, "mechanism": "copy_engine", "lag": None}),
]


def timeout_body(rank, world, use_gpu):
    """Rank 1 skips one call of each path: rank 0 raises an error naming op,
    rank and peer within the 1 s deadline (a peer that never comes fails a call
    under any deadline; the calls all ranks make keep the default), again on the
    next call (the workspace is broken), and works after reset_workspaces."""
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, dtype=torch.float32, device=device)
    w = torch.randn(32, 16, dtype=torch.float32, device=device)
    elapsed = []
    for op, config in TIMEOUT_CASES:
        call = getattr(ok, op)
        rows = _rows(rank, 8, world) if op == "gemm_rs" else slice(None)
        check_sum(dist, call(x, w, config=config), x, w, rows, what=op)  # all ranks
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(
                ok.OverlapTimeoutError, match=rf"^{op}: rank 0 waited more than 1 s for rank 1 "
            ) as e:
                call(x, w, config={**config, "timeout_s": 1.0})
                ok.raise_if_failed()  # on GPUs the error is read after the kernels ran
            elapsed.append(time.monotonic() - start)
            assert (e.value.op, e.value.rank, e.value.peer) == (op, 0, 1)
            # Again on the next call: the workspace is known to be broken.
            with pytest.raises(ok.OverlapTimeoutError, match=rf"^{op}: rank 0 "):
                call(x, w, config={**config, "timeout_s": 1.0})
        dist.barrier()  # rank 1 stays alive (and mapped) while rank 0 waits in vain
        ok.reset_workspaces()
    return elapsed


def test_peer_that_never_calls_raises_timeout_cpu():
    elapsed, silent = run_ranks(timeout_body, 2, False)
    assert silent == [] and len(elapsed) == len(TIMEOUT_CASES)
    # The 1 s deadline, not a hang (tests/test_deadlines.py holds it to 10%).
    assert all(t < 10 for t in elapsed), elapsed


# ---- bad inputs ---------------------------------------------------------------


def bad_input_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels import OverlapInputError as E
    from overlap_kernels.schedules import COPY_ENGINE, PUSH, SM_COPY, rounds

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, device=device)
    w = torch.randn(32, 16, device=device)
    rows = 8 * (rank + 1) // world - 8 * rank // world
    rs, ar = ok.gemm_rs, ok.gemm_ar
    shared = torch.randn(8 * 32, device=device)  # out and x in the same storage
    cases = []
    for op, call, out_shape in (("gemm_rs", rs, (rows, 16)), ("gemm_ar", ar, (8, 16))):
        name = "GemmRsConfig" if op == "gemm_rs" else "GemmArConfig"
        cases += [
            (lambda c=call: c(x, w.half()), f"{op}: x is torch.float32 but w is torch.float16; cast one"),
            (lambda c=call: c(x.int(), w.int()), f"{op}: x has dtype torch.int32; supported: bfloat16, float16, float32"),
            (lambda c=call: c(x, torch.randn(31, 16, device=device)), rf"{op}: x is \[M, K\] = \(8, 32\) but w is \(31, 16\), expected \[K=32, N\]"),
            (lambda c=call: c(x.t().contiguous().t(), w), f"{op}: x must be contiguous"),
            (lambda c=call: c(x, torch.randn(64, 16, device=device)[::2]), f"{op}: w must be row-major"),
            (lambda c=call: c(x, w, out=torch.empty(3, 3, device=device)), rf"{op}: out has shape \(3, 3\), expected \({out_shape[0]}, 16\)"),
            (lambda c=call, s=out_shape: c(x, w, out=torch.empty(s, device=device).half()), f"{op}: out has dtype torch.float16"),
            (lambda c=call, s=out_shape: c(shared[:256].view(8, 32), w, out=shared[: s[0] * 16].view(s)), f"{op}: out overlaps an input"),
            (lambda c=call: c(x, w, config={"bogus": 1}), rf"unknown {name} field\(s\) \['bogus'\]"),
            (lambda c=call: c(x, w, config={"pieces": 0}), f"{op}: config: pieces must be >= 1"),
            (lambda c=call: c(x, w, config={"loads": "ldg"}), f"{op}: config: loads must be tma or pointer"),
            (lambda c=call: c(x, w, config={"lag": 0}), f"{op}: config: lag must be .*>= 1, got 0"),
            (lambda c=call: c(x, w, config={"path": "bogus"}), f"{op}: config: path must be .*, got 'bogus'"),
            (lambda c=call: c(x, w, schedule="rounds"), f"{op}: schedule must be a ChunkSchedule"),
            (lambda c=call: c(x, w, schedule=rounds(world + 1)), f"{op}: schedule is for {world + 1} ranks, group has {world}"),
        ]  # fmt: skip
    cases += [
        (lambda: rs(x, w, reduce_op="max"), r"gemm_rs: reduce_op must be 'sum' or 'avg', got 'max'"),
        (lambda: rs(x, w, config={"mechanism": SM_COPY}), r"gemm_rs: config: mechanism must be push or copy_engine, got 'sm_copy'"),
        (lambda: rs(x, w, config={"mechanism": COPY_ENGINE, "comm_sms": 0}), "gemm_rs: config: comm_sms must be >= 1 with copy_engine"),
        (lambda: ar(x, w, config={"comm_sms": -1}), "gemm_ar: config: comm_sms must be >= 0, got -1"),
        (lambda: ar(x, w, config={"gather_streams": 0}), "gemm_ar: config: gather_streams must be >= 1, got 0"),
        (lambda: ar(x, w, config={"graph_path": "fused"}), "gemm_ar: config: graph_path must be one of same, sequential, got 'fused'"),
        (lambda: ar(x, w, config={"decode": "one_shot"}), r"unknown GemmArConfig field\(s\) \['decode'\]"),
        (lambda: rs(x, w, config={"producer": "numpy"}), "gemm_rs: config: producer must be triton or cublas, got 'numpy'"),
        (lambda: rs(x, w, config={"mechanism": PUSH, "producer": "cublas", "pieces": 2, "lag": 1}),
         "gemm_rs: config: producer 'cublas' computes every peer's piece before our GEMM runs the own rows: lag None or >= pieces, got lag 1"),
    ]  # fmt: skip
    if world == 1:
        cases += [
            (lambda: rs(x, w, config={"path": "fused"}), "gemm_rs: path='fused' cannot run: one rank: nothing to reduce"),
            (lambda: ar(x, w, config={"path": "one_shot"}), "gemm_ar: path='one_shot' cannot run: one rank"),
            (lambda: ar(x, w, config={"path": "two_shot"}), "gemm_ar: path='two_shot' cannot run: one rank"),
        ]  # fmt: skip
    else:
        stalls = r"schedule 'own first' is invalid:\n  rank 0, chunk 0 .*its reduction waits for ranks \[1"
        one_row = torch.randn(1, 32, device=device)
        cases += [
            # The validator allows sm_copy; the ops move partials only by push / copy_engine.
            (lambda: rs(x, w, schedule=rounds(world, 1, SM_COPY)), r"gemm_rs: schedule uses \['sm_copy'\]; gemm_rs moves partials by push, copy_engine"),
            (lambda: ar(x, w, schedule=rounds(world, 1, SM_COPY)), r"gemm_ar: schedule uses \['sm_copy'\]; gemm_ar moves partials by push, copy_engine"),
            (lambda: ar(x, w, schedule=rounds(world, 3, COPY_ENGINE, lag=1)), r"gemm_ar: a schedule whose partials are pulled \(copy_engine\) must put every rank's own pieces last"),
            (lambda: ar(x, w, config={"producer": "numpy"}), "gemm_ar: config: producer must be triton or cublas, got 'numpy'"),
            (lambda: ar(x, w, config={"producer": "cublas", "mechanism": COPY_ENGINE, "lag": None}),
             "gemm_ar: config: producer 'cublas' pushes partials only \\(mechanism push\\), got copy_engine"),
            (lambda: ar(x, w, schedule=rounds(world, 1, COPY_ENGINE), config={"producer": "cublas", "lag": None}),
             "gemm_ar: config producer 'cublas' pushes partials only: the schedule pulls them \\(copy_engine\\)"),
            (lambda: rs(x, w, schedule=_own_first(world)), f"gemm_rs: {stalls}"),
            (lambda: ar(x, w, schedule=_own_first(world)), f"gemm_ar: {stalls}"),
            (lambda: rs(x, w, schedule=rounds(world, 3, COPY_ENGINE, lag=1)), r"gemm_rs: a schedule whose partials are pulled \(copy_engine\) must put every rank's own pieces last"),
            (lambda: rs(x, w, config={"comm_sms": 1}, schedule=_descending(world, lambda j: (PUSH, COPY_ENGINE)[j % 2])), r"gemm_rs: schedule mixes \['copy_engine', 'push'\]"),
            (lambda: rs(x, w, schedule=rounds(world, 1, COPY_ENGINE)), r"gemm_rs: a schedule with copy_engine pulls needs config comm_sms >= 1"),
            (lambda: rs(x, w, schedule=_eager(world), config={"producer": "cublas"}),
             "gemm_rs: config producer 'cublas' computes every peer's piece before our GEMM runs the own rows: "
             "the schedule must put every rank's own pieces last"),
            (lambda: rs(one_row, w, config={"path": "fused"}), f"gemm_rs: path='fused' cannot run: M = 1 < {world} ranks"),
            (lambda: ar(one_row, w, config={"path": "two_shot"}), f"gemm_ar: path='two_shot' cannot run: M = 1 < {world} ranks"),
            (lambda: ar(x, w, config={"path": "two_shot", "comm_sms": 0}), "gemm_ar: path='two_shot' cannot run: two_shot needs comm_sms >= 1"),
            (lambda: rs(x[:, :30].contiguous().half(), w[:30].half(), config={"path": "fused"}), "gemm_rs: path='fused' cannot run: K \\* itemsize = 60 bytes"),
        ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(E, match=message):
            call()
    # The bad calls launched nothing: good calls after them are still right.
    check_sum(dist, rs(x, w), x, w, _rows(rank, 8, world), what="gemm_rs after bad inputs")
    check_sum(dist, ar(x, w), x, w, what="gemm_ar after bad inputs")
    # Layouts TMA cannot read take the sequential path under "auto", still right.
    odd, odd_w = (
        torch.randn(9, 30, dtype=torch.float16, device=device),
        torch.randn(30, 12, dtype=torch.float16, device=device),
    )
    check_sum(dist, rs(odd, odd_w), odd, odd_w, _rows(rank, 9, world), what="gemm_rs unaligned")
    check_sum(dist, ar(odd, odd_w), odd, odd_w, what="gemm_ar unaligned")
    return len(cases)


@pytest.mark.parametrize("world", [1, 2])
def test_bad_inputs_raise_before_launch_cpu(world):
    # 15 cases per op, 8 of one op or the other, and those of one rank or several: every one ran.
    assert (
        run_ranks(bad_input_body, world, False) == [2 * 15 + 9 + (3 if world == 1 else 16)] * world
    )


# ---- GPUs ---------------------------------------------------------------------


@gpu_ranks()
def test_correct_gpu(world, gpus, backend):
    assert all(run_on_gpus(correctness_body, world, gpus, backend))


@gpu_ranks(worlds=(2, 4))
def test_delayed_rank_and_25_calls_gpu(world, gpus, backend):
    assert run_on_gpus(delayed_and_back_to_back_body, world, gpus, backend) == [25] * world


@gpu_ranks(worlds=(2,))
def test_timeout_gpu(world, gpus, backend):
    elapsed, _ = run_on_gpus(timeout_body, world, gpus, backend)
    assert all(t < 10 for t in elapsed), elapsed


@gpu_ranks(worlds=(2,))
def test_bad_inputs_gpu(world, gpus, backend):
    run_on_gpus(bad_input_body, world, gpus, backend)
