"""A measured choice settling in place (ops/fastest.py): after the first call's
burst, the kept candidate's next calls and then the plain path's are timed as
the caller makes them, and every rank keeps the faster over all ranks.

On CPU (gloo ranks, Triton's interpreter) and, behind the ``gpu`` marker, on
CUDA GPUs, where the clock is events on the caller's stream."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import gpu_ranks, run_on_gpus, setup_rank

from overlap_kernels.launch import run_ranks
from overlap_kernels.ops.fastest import SWITCH_MARGIN
from overlap_kernels.reference import check_matmul, judge_reduced_matmul, poisoned


def fake_op_body(rank, world, slow_in_place):
    """A fake op whose "copy" candidate wins the first call's burst. In place it
    is slow on the last rank only when ``slow_in_place``: the max over ranks
    decides. The last rank's fourth call raises after the choice answered (the
    caller goes on): it must count alike on every rank."""
    from overlap_kernels.ops import fastest as f

    _, device = setup_rank(rank, False)
    last = rank == world - 1
    burst = {"copy": 0.01, "triton": 0.02, "plain": 0.05}
    in_place = {"copy": 0.10 if slow_in_place and last else 0.01, "triton": 0.02, "plain": 0.05}
    ran, unsettled = [], []

    @f.timed_in_place("fake")
    def op():
        candidate = f.fastest(
            "fake", ("fake", world, slow_in_place), lambda: list(burst),
            lambda c: time.sleep(burst[c]), None, device, is_plain=lambda c: c == "plain",
        )  # fmt: skip
        ran.append(candidate)
        time.sleep(in_place[candidate])
        if last and len(ran) == 4:
            raise RuntimeError("a failure of this rank alone")

    for _ in range(3 * f._CPU_SETTLE_ROUNDS * f._CPU_SETTLE_BLOCK + 2):
        try:
            op()
        except RuntimeError:
            pass
        unsettled.append(f.unsettled_calls("fake"))
    return ran, unsettled, [label for label, _ in f.last_measured["fake"]]


@pytest.mark.parametrize("slow_in_place", [True, False])
def test_every_candidate_is_timed_in_place_and_the_fastest_kept(slow_in_place):
    from overlap_kernels.ops.fastest import _CPU_SETTLE_BLOCK as block
    from overlap_kernels.ops.fastest import _CPU_SETTLE_ROUNDS as rounds

    calls = 3 * rounds * block
    in_turn = (["copy"] * block + ["triton"] * block + ["plain"] * block) * rounds
    settled = "triton" if slow_in_place else "copy"
    for ran, unsettled, labels in run_ranks(fake_op_body, 2, slow_in_place):
        assert ran == in_turn + [settled] * 2, ran
        assert unsettled == [*range(calls - 1, -1, -1), 0, 0], unsettled
        assert labels == ["copy", "triton", "plain", "copy in place", "triton in place", "plain in place"], labels


def plain_kept_body(rank, world, settle_plain):
    """A fake op whose plain candidate wins the first call's burst and loses in
    place (as gemm_ar's pair at decode sizes: the burst hides host time)."""
    from overlap_kernels.ops import fastest as f

    _, device = setup_rank(rank, False)
    burst = {"one_shot": 0.06, "plain": 0.01}  # 50 ms apart: a loaded CI machine cannot swap them
    in_place = {"one_shot": 0.01, "plain": 0.06}
    ran = []

    @f.timed_in_place("fake_plain")
    def op():
        candidate = f.fastest(
            "fake_plain", ("fake_plain", world, settle_plain), lambda: list(burst),
            lambda c: time.sleep(burst[c]), None, device, is_plain=lambda c: c == "plain", settle_plain=settle_plain,
        )  # fmt: skip
        ran.append(candidate)
        time.sleep(in_place[candidate])

    for _ in range(2 * f._CPU_SETTLE_ROUNDS * f._CPU_SETTLE_BLOCK + 2):
        op()
    return ran


@pytest.mark.parametrize("settle_plain", [True, False])
def test_a_kept_plain_path_settles_only_when_asked(settle_plain):
    from overlap_kernels.ops.fastest import _CPU_SETTLE_BLOCK as block
    from overlap_kernels.ops.fastest import _CPU_SETTLE_ROUNDS as rounds

    calls = 2 * rounds * block + 2
    in_turn = (["one_shot"] * block + ["plain"] * block) * rounds + ["one_shot"] * 2
    for ran in run_ranks(plain_kept_body, 2, settle_plain):
        assert ran == (in_turn if settle_plain else ["plain"] * calls), ran


def real_ops_body(rank, world, use_gpu):
    """ag_gemm, gemm_rs and gemm_ar with a first call made to keep a fused
    candidate: every call of the settling window is right, and every rank
    keeps the same path (returned with the times measured in place, one per
    candidate)."""
    import overlap_kernels as ok
    from overlap_kernels.ops import fastest as f

    dist, device = setup_rank(rank, use_gpu)
    f._medians_ms = lambda calls, device, group: [float(i) for i in range(len(calls))]  # the first candidate wins
    m, k, n = (512, 256, 384) if use_gpu else (10, 24, 20)
    x, w = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    w_parts = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(w_parts, w)
    rows = slice(rank * m // world, (rank + 1) * m // world)
    calls = {
        "ag_gemm": ({"path": "fused", "gemm": "fastest", "pull_sms": 2}, (m * world, n),
                    lambda out: check_matmul(out, torch.cat(parts), w, "ag_gemm")),
        "gemm_rs": ({"path": "fused", "mechanism": "fastest"}, (rows.stop - rows.start, n),
                    lambda out: _check_sum(out, [p[rows] for p in parts], w_parts, "gemm_rs")),
        "gemm_ar": ({"path": "two_shot", "mechanism": "fastest"}, (m, n),
                    lambda out: _check_sum(out, parts, w_parts, "gemm_ar")),
    }  # fmt: skip
    kept = {}
    for op, (config, shape, check) in calls.items():
        config = {**config, "timeout_s": 20.0}
        rounds, block = (f.SETTLE_ROUNDS, f.SETTLE_BLOCK) if use_gpu else (f._CPU_SETTLE_ROUNDS, f._CPU_SETTLE_BLOCK)
        for _ in range(rounds * block * CANDIDATES[op] + 1):
            out = poisoned(shape, x.dtype, device)
            getattr(ok, op)(x, w, config=config, out=out)
            ok.raise_if_failed()
            check(out)
        assert f.unsettled_calls(op) == 0, op
        in_place = [entry for entry in f.last_measured[op] if entry[0].endswith(" in place")]
        kept[op] = (getattr(ok.ops, op).running_config(x, w, None, config).path, in_place)
    return kept


def _check_sum(out, xs, ws, what):
    verdict = judge_reduced_matmul(out, xs, ws)
    assert verdict.problem is None, f"{what}: {verdict.problem}"


CANDIDATES = {"ag_gemm": 4, "gemm_rs": 5, "gemm_ar": 4}  # what each op's "fastest" times (with these shapes)


def _check_settled(kept: dict, interpreted: bool) -> None:
    for op, (path, in_place) in kept.items():
        assert len(in_place) == CANDIDATES[op], (op, in_place)
        # The first candidate kept was a fused one (triton, or push by our GEMM).
        assert in_place[0][0].split()[0] in ("gemm=triton", "mechanism=push"), (op, in_place)
        fastest, fastest_ms = min(in_place, key=lambda entry: entry[1])
        kept = fastest if fastest_ms * (1 + SWITCH_MARGIN) < in_place[0][1] else in_place[0][0]
        assert (path == "sequential") == (kept == "path=sequential in place"), (op, path, in_place)
        # Our GEMM in the interpreter is far slower than the plain path (cuBLAS
        # per chunk, torch.matmul on the CPU, can be level with it).
        assert not interpreted or in_place[0][1] > dict(in_place)["path=sequential in place"], (op, in_place)


def test_real_ops_settle_on_the_fastest_alike_on_every_rank_cpu():
    kept = run_ranks(real_ops_body, 2, False)
    assert kept[0] == kept[1] and set(kept[0]) == {"ag_gemm", "gemm_rs", "gemm_ar"}, kept
    _check_settled(kept[0], interpreted=True)


@gpu_ranks(worlds=(2, 4))
def test_real_ops_settle_alike_on_every_rank_gpu(world, gpus, backend):
    kept = run_on_gpus(real_ops_body, world, gpus, backend)
    assert all(k == kept[0] for k in kept) and set(kept[0]) == {"ag_gemm", "gemm_rs", "gemm_ar"}, kept
    _check_settled(kept[0], interpreted=False)
