"""ag_gemm on 1-4 rank processes: CPU (gloo, host backend, Triton's interpreter)
and, behind the ``gpu`` marker, CUDA GPUs (NCCL, PyTorch symmetric memory)."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import CPU_SHARED_WORLDS, gpu_ranks, run_on_gpus, runs_here, setup_rank

from overlap_kernels.launch import run_ranks
from overlap_kernels.reference import check_matmul, poisoned

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _gather(dist, x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def _schedules(world: int):
    from overlap_kernels import schedules as s
    from overlap_kernels.schedules.factories import from_source_order

    # A user's order: peers from the highest rank down, own rows last (local_first fixes that).
    user = from_source_order(
        world, lambda r: [p for p in reversed(range(world)) if p != r] + [r], "user"
    )
    return {
        "ring": s.ring(world),
        "direct": s.direct(world),
        "bidirectional": s.bidirectional(world),
        "split(ring,3)": s.split(s.ring(world), 3),
        "user": user,
        "local_first(user)": s.local_first(user),
        "sm_copy(split(direct,2))": s.with_mechanism(s.split(s.direct(world), 2), s.SM_COPY),
        "mixed": _mixed(s.split(s.ring(world), 2)),
        PUSHED: None,  # config mechanism "push": every rank pushes its rows, no schedule
    }


PUSHED = "push"


def _mixed(schedule):
    """Every other chunk by SM copy, the rest by the copy engine: a user schedule."""
    from dataclasses import replace

    from overlap_kernels.schedules import LOCAL, SM_COPY, ChunkSchedule

    lists = []
    for chunks in schedule.chunks:
        remote = [c for c in chunks if c.mechanism != LOCAL]
        swapped = {c: replace(c, mechanism=SM_COPY) for c in remote[::2]}
        lists.append(tuple(swapped.get(c, c) for c in chunks))
    return ChunkSchedule(schedule.world_size, tuple(lists), "mixed").validate()


TRITON_TMA = "triton+tma"  # our GEMM with the TMA epilogue
CHUNK_GROUPS = "triton+chunk_groups"  # our GEMM with group_by_chunk (kernels/gemm.py)
POINTER_LOADS = "triton+pointer_loads"  # our GEMM reading its operands by masked loads


def _gemms(schedule_name: str, world: int) -> tuple[str, ...]:
    """The consumers a schedule is tested with: cuBLAS takes copy-engine chunks
    only (it waits on their events); one rank takes the plain path anyway. The
    TMA epilogue on one schedule whose chunks cut blocks short inside the output;
    tile groups that end with their chunk on the ring; pointer loads where the rows
    are pushed (decode sizes, where they are meant to run)."""
    if schedule_name == PUSHED:
        return ("triton", TRITON_TMA, POINTER_LOADS)
    if world == 1 or "sm_copy" in schedule_name or schedule_name == "mixed":
        return ("triton",)
    if schedule_name == "ring":
        return ("triton", "cublas", CHUNK_GROUPS)
    return (
        ("triton", "cublas", TRITON_TMA)
        if schedule_name == "split(ring,3)"
        else ("triton", "cublas")
    )


def _consumer(gemm: str, dtype: torch.dtype, use_gpu: bool) -> dict:
    """The config fields of consumer ``gemm``; fp32 with the TMA epilogue gets
    128-wide tiles on a GPU (256-wide ones and the store tile exceed shared memory)."""
    if gemm == CHUNK_GROUPS:
        return {"gemm": "triton", "group_by_chunk": True}
    if gemm == POINTER_LOADS:
        return {"gemm": "triton", "loads": "pointer"}
    if gemm != TRITON_TMA:
        return {"gemm": gemm}
    narrow = {"block_n": 128} if use_gpu and dtype == torch.float32 else {}
    return {"gemm": "triton", "epilogue": "tma", **narrow}


def _sizes(use_gpu: bool, gemm: str = "triton"):
    # (M_local, K, N): ragged M_local (not a multiple of any block), N not a multiple of BLOCK_N.
    # On GPUs (520, 512, 4000) leaves a short last wave on 2 and 4 ranks (80 and
    # 160 tiles, 128 programs), whose tiles are split along K (kernels/gemm.py).
    if use_gpu:
        return [(200, 512, 1000), (520, 512, 4000), (1, 256, 384)]
    # The TMA epilogue also gets chunks of 16-17 rows (50 in three pieces): whole
    # 16-row blocks, which it stores by TMA, beside cut ones.
    return [(13, 64, 48), (1, 32, 40)] + ([(50, 64, 48)] if gemm == TRITON_TMA else [])


def correctness_body(rank, world, use_gpu):
    import overlap_kernels as ok

    dist, device = setup_rank(rank, use_gpu)
    errors = {}
    # A lost signal fails within 10 s (and is raised below) instead of 30.
    fused = {"path": "fused", "comm_sms": 4, "timeout_s": 10.0}
    case = -1
    for name, schedule in _schedules(world).items():
        if world == 1 and name != "ring":
            continue
        for gemm in _gemms(name, world):
            case += 1
            for d, dtype in enumerate(DTYPES):
                if not runs_here(world, use_gpu, case, d):
                    continue
                for m_local, k, n in _sizes(use_gpu, gemm):
                    x = torch.randn(m_local, k, dtype=dtype, device=device)
                    weight = torch.randn(n, k, dtype=dtype, device=device)  # nn.Linear layout
                    out = poisoned((m_local * world, n), dtype, device)
                    pushed = {"mechanism": "push"} if name == PUSHED else {}
                    config = (
                        {"path": "auto"}
                        if world == 1
                        else {**fused, **_consumer(gemm, dtype, use_gpu), **pushed}
                    )
                    result, gathered = ag_gemm_call(ok, x, weight.t(), schedule, config, out)
                    ok.raise_if_failed()  # a timeout is the error to report, not the numbers after it
                    assert result is out
                    reference_x = _gather(dist, x)
                    what = f"{name} {gemm} {dtype}"
                    assert torch.equal(gathered, reference_x), f"{what}: gathered rows differ"
                    errors[(name, gemm, str(dtype), m_local)] = check_matmul(
                        out, reference_x, weight.t(), what
                    )
    return errors


def ag_gemm_call(ok, x, w, schedule, config, out):
    return ok.ag_gemm(x, w, schedule=schedule, config=config, out=out, return_gathered=True)


class _LateCopies:
    """Wraps the kernel that announces this rank's rows and waits for its peers':
    after it, this rank sleeps, so its copies of the peers' rows start late while
    the peers, who saw the announcement, run ahead into their next call."""

    def __init__(self, kernel, seconds: float):
        self.kernel, self.seconds = kernel, seconds

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            launch(*args, **kwargs)
            time.sleep(self.seconds)

        return run


def delayed_and_back_to_back_body(rank, world, use_gpu):
    """One rank starts late; one rank copies late while its peers run ahead; then
    50 calls back to back with changing shapes, all checked only after the last
    (no collective in between to line the ranks up)."""
    import overlap_kernels as ok
    import overlap_kernels.kernels.transfer as transfer_step
    from overlap_kernels.runtime.workspace import get_workspace

    dist, device = setup_rank(rank, use_gpu)
    dtype = torch.bfloat16
    x = torch.randn(9, 64, dtype=dtype, device=device)
    w = torch.randn(64, 40, dtype=dtype, device=device)
    if rank == world - 1:
        time.sleep(1.5)  # every other rank waits for this one's rows
    out = ok.ag_gemm(x, w, config={"path": "fused", "gemm": "triton"})
    check_matmul(out, _gather(dist, x), w, "delayed rank")
    ws = get_workspace(None, device)
    buffer = ws.buffer
    calls = []
    announce_and_wait = transfer_step.exchange_ready_kernel
    # First a tiny call followed by a large one, twice, the pairs an odd number
    # of calls apart (so one pair starts on each of the two alternating
    # buffers), rank 1 copying late in the tiny calls: its peers publish the
    # large call's rows while it still reads the tiny call's. Then shapes that
    # vary call to call.
    first = [1, 3 * world + 1, 1, 1, 3 * world + 1]
    for i in range(50):
        if rank == 1 and i in (0, 3) and not use_gpu:
            transfer_step.exchange_ready_kernel = _LateCopies(announce_and_wait, 1.0)
        m_local, n = first[i] if i < len(first) else 1 + (7 * i) % 17, 16 * (1 + i % 4)
        # Each third call pulls by SM copy, each third is multiplied by cuBLAS per
        # chunk (on one stream or alternating between two; copies ahead on the
        # communication stream or in turn on the matmuls' streams: all four pairs).
        cublas = {
            "gemm": "cublas",
            "cublas_streams": 1 + i % 2,
            "cublas_copies": ("ahead", "in_turn")[i // 2 % 2],
        }
        mechanism = [{"mechanism": "sm_copy", "comm_sms": 2}, cublas, {"gemm": "triton"}][i % 3]
        if i % 5 == 4:  # every fifth call pushed, among calls that pull
            mechanism = {"mechanism": "push"}
        x = torch.randn(m_local, 64, dtype=dtype, device=device)
        w = torch.randn(64, n, dtype=dtype, device=device)
        out = ok.ag_gemm(
            x, w, config={"path": "fused", "gemm": "triton", "pieces": 1 + i % 3, **mechanism}
        )
        transfer_step.exchange_ready_kernel = announce_and_wait
        calls.append((x, w, out))
    ok.raise_if_failed()
    for i, (x, w, out) in enumerate(calls):
        check_matmul(out, _gather(dist, x), w, f"call {i}")
    # The workspace was made once and reused: no allocation or rendezvous per call.
    assert get_workspace(None, device) is ws and ws.buffer is buffer
    return ws.epoch


def timeout_body(rank, world, use_gpu):
    """Rank 1 skips a call: rank 0 gets an error naming op, rank, peer and chunk,
    from our GEMM and inside autotune() (whose first candidate's first call
    times out and raises, before the all-reduce of the times would hang)."""
    import contextlib

    import overlap_kernels as ok
    from overlap_kernels.runtime.signals import wait_budget

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, dtype=torch.float32, device=device)
    w = torch.randn(32, 16, dtype=torch.float32, device=device)
    elapsed = []
    for measuring in (contextlib.nullcontext, ok.autotune):
        config = {"path": "fused"}
        with measuring():
            ok.ag_gemm(x, w, config=config)  # both ranks: the workspace exists
        if rank == 0:
            # The deadline the message states: the host's for the agreement on the new
            # signature (timeout_s), or the device wait's for the peer's rows, on CUDA at
            # least 2**31 ns (signals.wait_budget), whole milliseconds in the error record.
            applied_s = wait_budget(1.0) // 1_000_000 / 1000
            expected = (r"ag_gemm: rank 0 waited more than (1 s for rank 1 \(agreement"
                        rf"|{applied_s:g} s for rank 1 \(its ready flag)")  # fmt: skip
            start = time.monotonic()
            with pytest.raises(ok.OverlapTimeoutError, match=expected), measuring():
                ok.ag_gemm(x, w, config={**config, "timeout_s": 1.0})
                ok.raise_if_failed()  # on GPUs the error is read after the kernels ran
            elapsed.append(time.monotonic() - start)
            # The same error again on the next call: the workspace is known to be broken.
            with pytest.raises(ok.OverlapTimeoutError):
                ok.ag_gemm(x, w, config={**config, "timeout_s": 1.0})
        dist.barrier()  # rank 1 stays alive (and mapped) while rank 0 waits in vain
        ok.reset_workspaces()
    return elapsed


def _missing_rows(world: int):
    """A user schedule in which every rank forgets its own rows."""
    from overlap_kernels.schedules import ChunkSchedule

    return ChunkSchedule(world, tuple(() for _ in range(world)), "forgetful")


def push_gives_way_body(rank, world, use_gpu, table):
    """A table's (or template's) push at this shape runs where the caller asks for
    nothing else, and gives way to copy-engine pulls where the caller passes a
    schedule or asks for cuBLAS; a push the caller asks for refuses a schedule."""
    import overlap_kernels as ok
    from overlap_kernels import tuned

    dist, device = setup_rank(rank, use_gpu)
    tuned.use_table(table)
    x = torch.randn(4, 32, device=device)
    w = torch.randn(48, 32, device=device).t()
    reference = _gather(dist, x)
    ran = []
    for config, schedule in (
        (None, None),
        ({"gemm": "cublas"}, None),
        (None, ok.schedules.ring(world)),
    ):
        out = ok.ag_gemm(x, w, schedule=schedule, config=config)
        check_matmul(out, reference, w, f"config {config}, schedule {schedule}")
        if schedule is None:
            ran.append(ok.ops.ag_gemm.running_config(x, w, config=config).mechanism)
    try:
        ok.ag_gemm(x, w, schedule=ok.schedules.ring(world), config={"mechanism": "push"})
    except ok.OverlapInputError as e:
        ran.append("takes no schedule" in str(e))
    return ran


def test_a_tables_push_gives_way_to_a_schedule_or_cublas_cpu(tmp_path):
    from overlap_kernels import tuned

    host = {**tuned.host_identity("cpu"), "world": 2, "date": "2026-11-26", "source": "test"}
    header = "".join(
        f'{k} = "{v}"\n' if isinstance(v, str) else f"{k} = {v}\n" for k, v in host.items()
    )
    table = tmp_path / "push.toml"
    table.write_text(f'[host]\n{header}\n[[ag_gemm]]\nm = 8\nk = 32\nn = 48\ndtype = "float32"\n'
                     'path = "fused"\nmechanism = "push"\nmeasured_ms = 0.01\n')  # fmt: skip
    assert (
        run_ranks(push_gives_way_body, 2, False, str(table)) == [["push", "copy_engine", True]] * 2
    )


def bad_input_body(rank, world, use_gpu):
    import overlap_kernels as ok
    from overlap_kernels import OverlapInputError as E

    dist, device = setup_rank(rank, use_gpu)
    x = torch.randn(8, 32, device=device)
    w = torch.randn(32, 16, device=device)
    cases = [
        (lambda: ok.ag_gemm(x.tolist(), w), "x must be a torch.Tensor"),
        (lambda: ok.ag_gemm(x[0], w), "x must be 2-D"),
        (lambda: ok.ag_gemm(x.to(torch.int32), w), "supported: bfloat16, float16, float32"),
        (lambda: ok.ag_gemm(x, w.half()), "x is torch.float32 but w is torch.float16"),
        (lambda: ok.ag_gemm(x, torch.randn(31, 16, device=device)), "expected \\[K=32, N\\]"),
        (lambda: ok.ag_gemm(x.t().contiguous().t(), w), "x must be contiguous"),
        (lambda: ok.ag_gemm(x, torch.randn(64, 32, device=device)[::2]), "w must be row-major"),
        (lambda: ok.ag_gemm(x, w, out=torch.empty(3, 3, device=device)), "out has shape"),
        (
            lambda: ok.ag_gemm(
                x, w, out=torch.empty(8 * world, 16, device=device, dtype=torch.half)
            ),
            "out has dtype",
        ),
        (lambda: ok.ag_gemm(x, w, config={"block_m": 24}), "block_m must be a power of two"),
        (lambda: ok.ag_gemm(x, w, config={"mechanism": "pigeon"}), "mechanism must be"),
        (lambda: ok.ag_gemm(x, w, config={"comm_sms": 0}), "comm_sms must be >= 1"),
        (
            lambda: ok.ag_gemm(x, w, config={"loads": "ldg"}),
            "loads must be tma or pointer, got 'ldg'",
        ),
        (lambda: ok.ag_gemm(x, w, config={"gemm": "numpy"}), "gemm must be triton or cublas"),
        (
            lambda: ok.ag_gemm(x, w, config={"gemm": "cublas", "mechanism": "sm_copy"}),
            "it needs mechanism copy_engine",
        ),
        (
            lambda: ok.ag_gemm(x, w, config={"cublas_streams": 3}),
            "cublas_streams must be 1 or 2, got 3",
        ),
        (
            lambda: ok.ag_gemm(x, w, config={"cublas_copies": "later"}),
            "cublas_copies must be ahead or in_turn",
        ),
        (lambda: ok.ag_gemm(x, w, config={"bogus": 1}), "unknown AgGemmConfig field"),
        (lambda: ok.ag_gemm(x, w, config=3), "config must be a AgGemmConfig or a dict"),
        (lambda: ok.ag_gemm(x, w, config={"timeout_s": 0}), "timeout_s must be > 0"),
        (lambda: ok.ag_gemm(x, w, schedule=ok.schedules.ring(world + 1)), "schedule is for"),
        (lambda: ok.ag_gemm(x, w, schedule="ring"), "schedule must be a ChunkSchedule"),
        (lambda: ok.ag_gemm(x, w, schedule=_missing_rows(world)), "is invalid:\n.*never arrive"),
        (
            lambda: ok.ag_gemm(
                x, w, schedule=ok.schedules.ring(world), config={"mechanism": "push"}
            ),
            "config mechanism 'push' takes no schedule",
        ),
        (
            lambda: ok.ag_gemm(x, w, config={"mechanism": "push", "gemm": "cublas"}),
            "it needs mechanism copy_engine",
        ),
    ]
    if world > 1:
        sm_copied = ok.schedules.with_mechanism(ok.schedules.ring(world), ok.schedules.SM_COPY)
        cases.append(
            (
                lambda: ok.ag_gemm(x, w, schedule=sm_copied, config={"gemm": "cublas"}),
                "this schedule has sm_copy chunks",
            )
        )
        odd = torch.randn(8, 30, dtype=torch.float16, device=device)  # 60-byte rows: no TMA
        odd_w = torch.randn(30, 16, dtype=torch.float16, device=device)
        cases.append(
            (lambda: ok.ag_gemm(odd, odd_w, config={"path": "fused"}), "not a multiple of 16")
        )
    for call, message in cases:
        with pytest.raises(E, match=message):
            call()
    # The bad calls launched nothing: a good call after them is still right.
    out = ok.ag_gemm(x, w)
    check_matmul(out, _gather(dist, x), w, "after bad inputs")
    # Unaligned shapes take the plain path under "auto" and are still right.
    odd = torch.randn(5, 30, dtype=torch.float16, device=device)
    odd_w = torch.randn(30, 12, dtype=torch.float16, device=device)
    check_matmul(ok.ag_gemm(odd, odd_w), _gather(dist, odd), odd_w, "unaligned, plain path")
    return len(cases)


def sm_copy_shares_body(rank, world, use_gpu):
    """SM pulls with chunks many times a copy block: every program copies a
    share of every chunk (a masked end block where a share is ragged), and the
    last to finish a chunk releases it. The CPU tests' chunks are smaller than
    one block of the real size, so the block is made tiny here."""
    import overlap_kernels as ok
    from overlap_kernels.ops.ag_gemm_details import transfer

    dist, device = setup_rank(rank, use_gpu)
    transfer._COPY_BLOCK_WORDS = 8
    # Rows of 12 words: chunks of 60, 84 and 36 words, shares of 24, 24 and 8
    # words with a ragged last one (12, 12, 4), and programs with none.
    for programs, m_local in ((3, 5), (5, 7), (7, 3)):
        x = torch.randn(m_local, 12, device=device)
        w = torch.randn(12, 24, device=device)
        out = poisoned((m_local * world, 24), x.dtype, device)
        config = {
            "path": "fused",
            "gemm": "triton",
            "mechanism": "sm_copy",
            "comm_sms": programs,
            "timeout_s": 20.0,
        }
        ok.ag_gemm(x, w, config=config, out=out)
        check_matmul(out, _gather(dist, x), w, f"sm_copy, {programs} programs")
    return True


def test_sm_copy_shares_cpu():
    assert run_ranks(sm_copy_shares_body, 3, False) == [True] * 3


CPU_WORLDS = [1, *CPU_SHARED_WORLDS]


@pytest.mark.parametrize("world", CPU_WORLDS)
def test_correct_every_schedule_dtype_and_ragged_shape_cpu(world):
    errors = run_ranks(correctness_body, world, False)
    pairs = [("ring", "triton")] if world == 1 else \
        [(name, gemm) for name in _schedules(world) for gemm in _gemms(name, world)]  # fmt: skip
    expected = sum(len(_sizes(False, gemm)) * runs_here(world, False, c, d)
                   for c, (_, gemm) in enumerate(pairs) for d in range(len(DTYPES)))  # fmt: skip
    assert all(len(e) == expected for e in errors), "a case did not run"


# Three ranks (a delayed rank among two peers); two are the GPU variant's.
@pytest.mark.parametrize("world", [3])
def test_delayed_rank_and_50_calls_cpu(world):
    epochs = run_ranks(delayed_and_back_to_back_body, world, False)
    assert epochs == [51] * world


def test_peer_that_never_signals_raises_timeout_cpu():
    elapsed, silent = run_ranks(timeout_body, 2, False)
    assert silent == [] and len(elapsed) == 2 and all(t < 10 for t in elapsed), (
        elapsed
    )  # a 1 s deadline, not a hang


@pytest.mark.parametrize("world", [1, 2])
def test_bad_inputs_raise_before_launch_cpu(world):
    assert all(n > 10 for n in run_ranks(bad_input_body, world, False))


@gpu_ranks()
def test_correct_gpu(world, gpus, backend):
    assert all(run_on_gpus(correctness_body, world, gpus, backend))


@gpu_ranks(worlds=(2, 4))
def test_delayed_rank_and_50_calls_gpu(world, gpus, backend):
    assert run_on_gpus(delayed_and_back_to_back_body, world, gpus, backend) == [51] * world


@gpu_ranks(worlds=(2,))
def test_timeout_gpu(world, gpus, backend):
    elapsed, _ = run_on_gpus(timeout_body, world, gpus, backend)
    assert len(elapsed) == 2 and all(t < 10 for t in elapsed), elapsed  # a 1 s deadline, not a hang


@gpu_ranks(worlds=(2,))
def test_bad_inputs_gpu(world, gpus, backend):
    run_on_gpus(bad_input_body, world, gpus, backend)
