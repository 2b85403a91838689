"""One plan per call signature (ops/plans.py), the deterministic choice without
a tuned table, and the opt-in autotune (ops/autotune.py).

Each body counts the plans made (``plans.made``), so a repeated call that
silently made a plan again, or a changed signature that reused one, fails.
"""

from __future__ import annotations

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, runs_here, setup_rank
from test_ag_gemm import _gather
from test_gemm_rs_ar import _rows, check_sum

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul

# (op, config): fixed paths, and the template's "auto" (the interpreter's
# takes one_shot up to 16 rows, two_shot above).
CALLS = (
    ("gemm_ar", {"path": "one_shot", "timeout_s": 20.0}),
    ("gemm_ar", {"path": "two_shot", "mechanism": "push", "timeout_s": 20.0}),
    ("gemm_ar", {"path": "two_shot", "mechanism": "copy_engine", "timeout_s": 20.0}),
    ("gemm_ar", {"path": "sequential"}),
    ("gemm_ar", None),
    ("gemm_rs", {"path": "fused", "mechanism": "copy_engine", "comm_sms": 1, "timeout_s": 20.0}),
    ("gemm_rs", None),
    ("ag_gemm", None),
    ("ag_gemm", {"path": "fused", "gemm": "cublas", "timeout_s": 20.0}),
)
SHAPES = ((8, 48, 40), (24, 32, 56))  # (M, K, N): ragged against the 16 x 32 tiles


def _check(ok, dist, op, config, x, w, out=None, what=""):
    """One call of ``op``, checked against the float64 sum or product over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = getattr(ok, op)(x, w, config=config, out=out)
    ok.raise_if_failed()
    assert out is None or result is out, what
    if op == "ag_gemm":
        check_matmul(result, _gather(dist, x), w, what)
    else:
        check_sum(
            dist,
            result,
            x,
            w,
            _rows(rank, x.shape[0], world) if op == "gemm_rs" else slice(None),
            what=what,
        )


def plans_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels.ops import autotune, plans
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32

    def inputs(m, k, n, dtype=dtype):
        return torch.randn(m, k, dtype=dtype, device=device), torch.randn(
            k, n, dtype=dtype, device=device
        )

    for c, (op, config) in enumerate(CALLS):
        if not runs_here(world, use_gpu, c, 0):  # (CPU ranks: its share of the calls)
            continue
        for m, k, n in SHAPES:  # each signature's first call makes its plan
            _check(ok, dist, op, config, *inputs(m, k, n), what=f"{op} {config} {m}x{k}x{n} first")
        made = plans.made[op]
        # The two signatures in an uneven order (each meets both buffer halves),
        # fresh inputs every call: right, and no plan is made again.
        for m, k, n in (SHAPES[0], SHAPES[0], SHAPES[1], SHAPES[0], SHAPES[1], SHAPES[1]):
            _check(ok, dist, op, config, *inputs(m, k, n), what=f"{op} {config} {m}x{k}x{n}")
        # An out argument, and x at an odd address on one rank only, use the plan too.
        m, k, n = SHAPES[0]
        x, w = inputs(m, k, n)
        rows = (
            m * world
            if op == "ag_gemm"
            else (
                _rows(rank, m, world).stop - _rows(rank, m, world).start if op == "gemm_rs" else m
            )
        )
        _check(
            ok,
            dist,
            op,
            config,
            x,
            w,
            out=torch.full((rows, n), float("nan"), dtype=dtype, device=device),
            what="out",
        )
        odd = torch.randn(m * k + 1, dtype=dtype, device=device)[rank % 2 :][: m * k].view(m, k)
        _check(ok, dist, op, config, odd, w, what="unaligned x")
        assert plans.made[op] == made, (op, config, plans.made[op], made)

    # What a signature is: a changed stride, dtype, group or config makes a new plan.
    op, config = "gemm_ar", {"path": "one_shot", "timeout_s": 20.0}
    m, k, n = SHAPES[0]
    x, w = inputs(m, k, n)
    # Its plan first: on CPU ranks this world's share of CALLS may not have made it.
    _check(ok, dist, op, config, x, w, what="the signature's plan")
    made = plans.made[op]
    linear = torch.randn(n, k, dtype=dtype, device=device).t()  # w's other layout: weight.t()
    other_dtype = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    subgroup = dist.new_group(list(range(world)))
    for what, call in (
        ("stride", lambda: ok.gemm_ar(x, linear, config=config)),
        ("dtype", lambda: ok.gemm_ar(*inputs(m, k, n, other_dtype), config=config)),
        ("group", lambda: ok.gemm_ar(x, w, subgroup, config=config)),
        ("config", lambda: ok.gemm_ar(x, w, config={**config, "timeout_s": 19.0})),
    ):
        call()
        ok.raise_if_failed()
        assert plans.made[op] == made + 1, what
        made += 1
        call()
        assert plans.made[op] == made, f"{what}: the repeat made a plan"

    # The workspace grown by another call: the plan makes the new buffer's launch plans.
    ws = get_workspace(None, device)
    buffer = ws.buffer
    ws.begin("test", 2 * ws.data_capacity, 20.0)  # every rank alike: an epoch of its own
    ws.finish()
    assert ws.buffer is not buffer
    _check(ok, dist, op, config, x, w, what="after the workspace grew")
    assert plans.made[op] == made
    # reset_workspaces() forgets every plan (they hold workspaces).
    ok.reset_workspaces()
    _check(ok, dist, op, config, x, w, what="after reset_workspaces")
    assert plans.made[op] == made + 1
    # Nothing was measured outside autotune(), and every rank decided alike.
    assert autotune.last_measured == {}
    running = [ok.ops.ag_gemm.running_config(*inputs(8, 32, 32)), ok.ops.gemm_rs.running_config(*inputs(8, 32, 32)),
               ok.ops.gemm_ar.running_config(*inputs(8, 32, 32)), ok.ops.gemm_ar.running_config(*inputs(64, 32, 32))]  # fmt: skip
    everyone = [None] * world
    dist.all_gather_object(everyone, running)
    assert all(r == running for r in everyone), everyone
    return plans.made["gemm_ar"]


@pytest.mark.parametrize("world", CPU_SHARED_WORLDS)
def test_one_plan_per_signature_cpu(world):
    made = run_ranks(plans_body, world, False)
    assert len(set(made)) == 1, made


@gpu_ranks(worlds=(2, 4))
def test_one_plan_per_signature_gpu(world, gpus, backend):
    made = run_on_gpus(plans_body, world, gpus, backend)
    assert len(set(made)) == 1, made


def timeout_body(rank, world, use_gpu):
    """A peer that stops calling fails a planned call as it fails a first one:
    the error names op, rank and peer; the next call raises it too."""
    import overlap_kernels as ok
    from overlap_kernels.ops import plans

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, dtype=torch.float32, device=device)
    w = torch.randn(32, 16, dtype=torch.float32, device=device)
    config = {"path": "one_shot", "timeout_s": 3.0}
    for _ in range(2):  # the plan's first call, then a repeated one
        check_sum(dist, ok.gemm_ar(x, w, config=config), x, w, what="before the silence")
    raised = 0
    if rank == 0:
        for _ in range(2):
            with pytest.raises(
                ok.OverlapTimeoutError, match=r"^gemm_ar: rank 0 waited more than 3 s for rank 1 "
            ) as e:
                ok.gemm_ar(x, w, config=config)
                ok.raise_if_failed()  # on GPUs the error is read after the kernel ran
            assert (e.value.op, e.value.rank, e.value.peer) == ("gemm_ar", 0, 1)
            raised += 1
        assert plans.made["gemm_ar"] == 1
    dist.barrier()  # rank 1 stays alive (and mapped) while rank 0 waits in vain
    ok.reset_workspaces()
    return raised


def test_silent_peer_fails_a_planned_call_with_the_timeout_cpu():
    assert run_ranks(timeout_body, 2, False) == [2, 0]


@gpu_ranks(worlds=(2,))
def test_silent_peer_fails_a_planned_call_with_the_timeout_gpu(world, gpus, backend):
    assert run_on_gpus(timeout_body, world, gpus, backend) == [2, 0]


def autotune_body(rank, world, use_gpu, table):
    """Inside autotune(): a new signature's first call measures the op's
    candidates (a collective), every rank keeps the same, the result is right,
    and later calls neither measure nor make a plan. The choice lands in the
    cache table, which a later process reads instead of measuring; fields the
    caller sets are not tuned."""
    import overlap_kernels as ok
    from overlap_kernels import tuned
    from overlap_kernels.ops import autotune, plans

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16 if use_gpu else torch.float32
    m, k, n = 32, 32, 48
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(k, n, dtype=dtype, device=device)
    xa = x[: m // world]
    config = {"timeout_s": 20.0}
    kept = {}
    with ok.autotune(cache=table):
        for op, args in (("gemm_rs", (x, w)), ("gemm_ar", (x, w)), ("ag_gemm", (xa, w))):
            _check(ok, dist, op, config, *args, what=f"{op} measured")
            measured = autotune.last_measured.pop(op)
            assert len(measured) >= 2, measured  # fused candidates and the plain path
            kept[op] = getattr(ok.ops, op).running_config(*args, config=config)
            made = plans.made[op]
            _check(ok, dist, op, config, *args, what=f"{op} kept")
            assert op not in autotune.last_measured and plans.made[op] == made, op
        # A field the caller sets is not tuned: only candidates that keep it are
        # measured, and that choice is not the shape's: the table keeps the first.
        _check(ok, dist, "gemm_rs", {**config, "mechanism": "push"}, x, w, what="mechanism fixed")
        assert all("copy_engine" not in label for label, _ in autotune.last_measured.pop("gemm_rs"))
    everyone = [None] * world
    dist.all_gather_object(everyone, kept)
    assert all(k == kept for k in everyone), everyone
    dist.barrier()  # rank 0 has written the table
    entries = tuned.read_table(table)
    assert {"gemm_rs", "gemm_ar", "ag_gemm"} <= set(entries), entries
    # A later process (here: plans forgotten, the table loaded) takes the table's choice, measuring nothing.
    plans.forget_plans()
    with ok.autotune(cache=table):
        for op, args in (("gemm_rs", (x, w)), ("gemm_ar", (x, w)), ("ag_gemm", (xa, w))):
            _check(ok, dist, op, config, *args, what=f"{op} from the table")
            assert op not in autotune.last_measured, op
            assert getattr(ok.ops, op).running_config(*args, config=config) == kept[op], op
    tuned.forget_tables()
    return {op: cfg.path for op, cfg in kept.items()}


def test_autotune_measures_once_and_records_the_choice_cpu(tmp_path):
    paths = run_ranks(autotune_body, 2, False, str(tmp_path / "table.toml"))
    assert paths[0] == paths[1]


@gpu_ranks(worlds=(2,))
def test_autotune_measures_once_and_records_the_choice_gpu(world, gpus, backend, tmp_path):
    paths = run_on_gpus(autotune_body, world, gpus, backend, str(tmp_path / "table.toml"))
    assert len(set(map(str, paths))) == 1


def test_a_plan_is_kept_only_under_a_process_group():
    """Without a process group (none yet, or destroyed) a call has no signature:
    its plan is not kept, and making it says what is wrong."""
    import torch.distributed as dist

    from overlap_kernels.ops.plans import signature

    assert not dist.is_initialized()
    assert signature("gemm_ar", torch.ones(2, 2), torch.ones(2, 2), None, None) is None
    assert (
        signature("gemm_ar", torch.ones(2, 2), torch.ones(2, 2), None, {"pieces": [1]}) is None
    )  # not a key


def test_tune_command_writes_a_table(tmp_path, capfd):
    from overlap_kernels import tune, tuned

    table = tmp_path / "host.toml"
    assert (
        tune.main(
            [
                "--op",
                "gemm_rs",
                "--world",
                "2",
                "--shapes",
                "16x32x48",
                "--dtype",
                "float32",
                "--out",
                str(table),
            ]
        )
        == 0
    )
    assert (
        "[1/1] gemm_rs 16x32x48" in capfd.readouterr().out
    )  # (printed by rank 0, a child process)
    entries = tuned.read_table(table)["gemm_rs"]
    assert [(e["m"], e["k"], e["n"], e["dtype"]) for e in entries] == [(16, 32, 48, "float32")]
    assert entries[0]["measured_ms"] > 0
    with pytest.raises(SystemExit):
        tune.main(
            ["--op", "ag_gemm", "--world", "2", "--shapes", "15x32x48", "--out", str(table)]
        )  # M not divisible
