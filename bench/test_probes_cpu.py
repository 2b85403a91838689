"""The GEMM probes' shared steps and probe_persistent_loops' kernel, on CPU (Triton's
interpreter, which runs every loop form alike: it shows the tile order, the waits'
tile rows and the three stores, not what the compiler makes of them). Times on CPU
mean nothing; do_bench is replaced where the timing steps are checked.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from bench import experiments
from bench.experiments import probe_persistent_loops as probe
from bench.gemm_cores import Problem
from overlap_kernels.kernels.gemm import mblock_table

# M, K, N not multiples of the tile (the last M-block and N-block are cut short).
M, K, N = 40, 96, 80
TILE = (16, 32, 32, 2, 4)  # (block_m, block_n, block_k, stages, warps): halves of 16 columns


def _problem() -> Problem:
    torch.manual_seed(0)
    a, weight = torch.randn(M, K), torch.randn(N, K)  # fp32: the interpreter's bf16 dots are wrong
    return Problem({"M": M, "K": K, "N": N}, a, weight.t(), torch.empty(M, N),
                   lambda: a @ weight.t(), a @ weight.t())  # fmt: skip


@pytest.mark.parametrize(
    "loop,epilogue",
    list(itertools.product(("nested", "nested_waits", "flatten", "ws_k"), probe.EPILOGUES)),
)
def test_each_loop_and_store_of_the_probe_computes_the_product(loop, epilogue):
    p = _problem()
    table = mblock_table([(0, M, -1, 0)], TILE[0], "cpu")
    flags = torch.zeros(64, dtype=torch.int32)
    programs = 3  # fewer than the 15 tiles: each program runs several
    call = probe._launcher(p, TILE, loop, epilogue, programs, table, flags)
    p.out.fill_(float("nan"))
    call()
    # fp32 products in the interpreter: within a few ulps of the reference; a wrong or
    # unwritten tile is O(1) or NaN.
    torch.testing.assert_close(p.out, p.reference, rtol=1e-5, atol=1e-4)


def test_working_keeps_the_right_calls_and_reports_the_others(capsys):
    p = _problem()

    def right():
        p.out.copy_(p.reference)

    def wrong():
        p.out.copy_(p.reference)
        p.out[3, 5] += 1.0

    def refused():
        raise RuntimeError("out of shared memory")

    kept = experiments.working(p, {"right": right, "wrong": wrong, "refused": refused})
    assert list(kept) == ["right"]
    printed = capsys.readouterr().out
    assert (
        "wrong: WRONG" in printed
        and "refused: refused (RuntimeError: out of shared memory)" in printed
    )


def test_ranked_against_cublas_times_in_rounds_and_drops_a_call_that_fails(monkeypatch, capsys):
    import triton

    times = {"cublas": 2.0, "fast": 1.0, "slow": 4.0}
    order = []

    def fake_do_bench(fn, **kw):
        name = fn()
        order.append(name)
        return times[name]

    def broken():
        raise RuntimeError("launch failed")

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    calls = {name: (lambda name=name: name) for name in times} | {"broken": broken}
    record = experiments.ranked_against_cublas("8x16x32", calls, rounds=2)
    # Interleaved rounds, the vendor's follower in turn, the failed call dropped.
    assert order == ["cublas", "fast", "slow", "cublas", "slow", "fast"]
    assert record == {"shape": "8x16x32", "cublas_ms": 2.0, "ours": {"fast": 1.0, "slow": 4.0}}
    printed = capsys.readouterr().out
    assert "broken: failed while timed (RuntimeError: launch failed)" in printed
    assert (
        printed.index("x0.500  fast")
        < printed.index("x1.000  cublas")
        < printed.index("x2.000  slow")
    )


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("load", ["tma", "pointer"])
def test_the_weight_stream_probe_reads_every_element_once(split, load):
    from bench.experiments import probe_weight_stream as stream_probe

    torch.manual_seed(0)
    # 80 rows: the last 32-row block is cut short; K = 100: the last 32-wide K tile too.
    weight = torch.randn(N, 100)
    out = torch.full((3 * split,), float("nan"))
    stream_probe.stream(weight, out, (32, 32, 2, 2), split, load)
    # fp32 sums of 8,000 values in another order: a missed or twice-read tile is O(1) off.
    torch.testing.assert_close(out.double().sum(), weight.double().sum(), rtol=0, atol=1e-3)
    assert stream_probe._sums_agree(weight, out, 32, 32, split)
    out[-1] += 1.0  # (the check's bound is 1e-5 of a block's absolute sum, ~10^3: ~0.01)
    assert not stream_probe._sums_agree(weight, out, 32, 32, split)


@pytest.mark.parametrize("load", ["tma", "pointer"])
def test_the_weight_stream_probes_gemm_computes_the_product(load):
    from bench.experiments import probe_weight_stream as stream_probe

    p = _problem()  # fp32: the interpreter's bf16 dots are wrong
    x, weight = p.a[:5].contiguous(), p.b.t().contiguous()
    out = torch.full((5, N), float("nan"))
    stream_probe.decode_gemm(x, weight, out, 16, (32, 32, 2, 2), load)
    torch.testing.assert_close(out, p.reference[:5], rtol=1e-5, atol=1e-4)


def test_compiled_step_probe_counts_the_calls_of_generated_code():
    """probe_compiled_step's reading of Inductor's ``call()``: kernels, extern GEMMs,
    ops (not the comments or asserts that name them) and allocated bytes."""
    from bench.experiments.probe_compiled_step import calls

    code = """
def call(args):
    buf0 = torch.ops.overlap_kernels.ag_gemm.default(x, w, '0', return_gathered=True)
    assert_size_stride(buf1, (32, 32), (32, 1), 'torch.ops.overlap_kernels.ag_gemm.default')
    # buffer buf1 (op: torch.ops.overlap_kernels.ag_gemm.default) is assumed to be not aligned
    buf3 = empty_strided_cuda((32, 16), (16, 1), torch.bfloat16)
    triton_poi_fused_silu_0.run(buf1, buf3, 512, stream=stream0)
    cpp_fused_silu_backward_1(buf5, buf1)
    extern_kernels.mm(buf3, w2, out=buf4)
"""
    assert calls(code) == {
        "op overlap_kernels.ag_gemm": 1,
        "alloc bfloat16": 1,
        "bytes bfloat16": 32 * 16 * 2,
        "kernel triton_poi_fused_silu": 1,
        "kernel cpp_fused_silu_backward": 1,
        "extern mm": 1,
    }
