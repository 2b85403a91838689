"""Micro benchmarks (pytest-benchmark): the host-side costs on an op's hot path.

On small shapes a fused call's time is its host time (bench/logs: ~190 us to
enqueue one ag_gemm call on the H200 hosts), so what Python does per call is
measured here, on any machine: building and validating schedules (a cache
removed ~100 us per call), resolving a config, looking a plan up. The GPU entry
times the local GEMM core against cuBLAS where there is a GPU, and checks the
product of each against float64.

Run: ``python -m pytest bench/test_micro.py --benchmark-enable`` (the normal
test run passes ``--benchmark-disable``: each body then runs once, as a test).
"""

from __future__ import annotations

import pytest
import torch

import overlap_kernels as ok
from overlap_kernels import schedules
from overlap_kernels.tuning import build_config, shape_key


def test_schedule_by_name_is_cached(benchmark):
    schedule = benchmark(schedules.by_name, "ring", 8, "copy_engine", 4)
    assert schedule is schedules.by_name("ring", 8, "copy_engine", 4)


def test_schedule_build_and_validate(benchmark):
    schedule = benchmark(lambda: schedules.split(schedules.ring(8), 4).validate())
    assert len(schedule.for_rank(0)) == 8 * 4


def test_schedule_validation_is_cached(benchmark):
    schedule = schedules.split(schedules.ring(8), 4)
    schedule.validate()
    assert benchmark(schedule.problems) == []


def test_config_resolution_default(benchmark):
    key = shape_key(4, 8192, 8192, 7168, torch.bfloat16)
    config = benchmark(build_config, ok.AgGemmConfig, "ag_gemm", key, None)
    assert config.path == "auto"


def test_config_resolution_with_override(benchmark):
    key = shape_key(4, 8192, 8192, 7168, torch.bfloat16)
    config = benchmark(build_config, ok.AgGemmConfig, "ag_gemm", key, {"pieces": 2})
    assert config.pieces == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["ours", "cublas"])
def test_local_gemm_8192(benchmark, impl):
    from overlap_kernels.reference import check_matmul, poisoned

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(7168, 8192, device="cuda", dtype=torch.bfloat16)
    out = poisoned((8192, 7168), torch.bfloat16, "cuda")
    gemm = ok.matmul if impl == "ours" else torch.matmul

    def timed():
        result = gemm(a, weight.t(), out=out)
        torch.cuda.synchronize()
        return result

    timed()  # compile outside the timing
    benchmark.pedantic(timed, rounds=20, warmup_rounds=3)
    out.fill_(float("nan"))  # the checked call's tiles all written, or NaN shows
    # The library's oracle against float64: the relative error at most twice the plain
    # fp32-accumulated bf16 product's, every element within the rounding to bf16 plus the
    # fp32 bound on 8192 summed products (reference.judge_matmul says why those bounds).
    check_matmul(timed(), a, weight.t(), impl)
