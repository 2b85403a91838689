"""Where a GEMM core's call goes, beside the vendor's: Nsight Compute's sections for one of each.

``bench.tune_gemm`` says by how much a core trails the vendor's kernel; this says where:
per call (at the clocks the profiler fixes), the SM clock, the tensor pipes' and memory's
throughput, the L2 hit rate, the occupancy and the warps' stall reasons. Each shape's vendor
call and each core's call (the template's config) run warmed up, then once more between
``cudaProfilerStart`` and ``cudaProfilerStop``, so a profiler started with
``--profile-from-start off`` sees one call of each:

``ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis
--section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
python -m bench.experiments.profile_cores [--core NAME]... [SHAPE ...]`` (one GPU;
shapes MxKxN, default: SHAPES; stall samples by reason: ``--metrics
smsp__pcsamp_warps_issue_stalled_barrier,...``, bench/logs/profile_cores_*.log).
"""

from __future__ import annotations

import argparse

import torch

from bench import gemm_cores
from bench.experiments import working
from bench.tune_gemm import _one_rank_group, _shape


def _dense_shape(text: str) -> tuple[int, int, int]:
    shape = _shape(text)
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"a dense core's shape is MxKxN, got '{text}'")
    return shape


# A shape level with cuBLAS, a short last wave, a short K and an odd M (docs/performance.md,
# "The GEMM cores against the vendor").
SHAPES = ((16384, 8192, 7168), (2048, 8192, 7168), (4096, 2048, 8192), (1537, 4096, 3584))
WARMUP = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", action="append", choices=["matmul", "chunked_gemm", "reduce_gemm"],
                        help="a dense core to profile (repeat for several; default: matmul, reduce_gemm)")  # fmt: skip
    parser.add_argument("shapes", nargs="*", type=_dense_shape, metavar="SHAPE", help="MxKxN")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    cores = args.core or ["matmul", "reduce_gemm"]
    if "reduce_gemm" in cores and (why := _one_rank_group()):
        parser.error(why)
    device = torch.device("cuda", torch.cuda.current_device())
    cudart = torch.cuda.cudart()
    for shape in args.shapes or SHAPES:
        for i, name in enumerate(cores):
            core = gemm_cores.CORES[name]
            problem = core.problem(shape, device)
            knobs = gemm_cores.template_knobs(name, problem.shape, device)
            calls = working(problem, {name: core.ours(problem, knobs)})
            if i == 0:  # (the vendor's call returns its product: working() reads problem.out)
                calls = {core.vendor: problem.vendor, **calls}
            for label, call in calls.items():
                for _ in range(WARMUP):
                    call()
                torch.cuda.synchronize()
                print(f"profiled: {'x'.join(map(str, shape))} {label}", flush=True)
                cudart.cudaProfilerStart()
                call()
                torch.cuda.synchronize()
                cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()
