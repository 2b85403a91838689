"""Replay each variant of the decode entry (bench/decode.py) alone, every input set's
graph in turn, at one rank, each variant in a process of its own (an illegal address
poisons the CUDA context): which variant's replays fault, if any.

    python -m bench.experiments.probe_decode_replays [MxKxN]
"""

from __future__ import annotations

import os
import subprocess
import sys

VARIANTS = ("cublas", "nccl_all_reduce", "symm_one_shot", "nccl_norm", "symm_norm", "ours_all_reduce",
            "ours_all_reduce_rmsnorm", "cublas_ours_norm", "ours")  # fmt: skip


def one(name: str, shape: str) -> None:
    import tempfile

    import torch
    import torch.distributed as dist

    from bench import decode, harness
    from bench.common import parse_shape
    from overlap_kernels.timing import group_barrier

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    device = torch.device("cuda", 0)
    ctx = harness.RunContext(
        0, 1, device, None, harness.CudaClock(), group_barrier(None, device), None
    )
    m, k, n = parse_shape(shape)
    sets = [decode._make_inputs(m, k, n, ctx, seed) for seed in range(3)]
    ours, missing = decode.load_ours(
        "all_reduce", ("all_reduce", "all_reduce_rmsnorm", "gemm_ar_rmsnorm")
    )
    variants, _ = decode._variants(ctx, sets, ours, missing)
    (variant,) = [v for v in variants if v.name == name]
    if variant.fn is None:
        print(f"{name}: not runnable: {variant.note}")
        return
    for _ in range(12):
        variant.fn()
        torch.cuda.synchronize()
    print(f"{name}: 12 replays ok")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
        sys.exit(0)
    shape = sys.argv[1] if len(sys.argv) > 1 else "1x4096x4096"
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for name in VARIANTS:
        proc = subprocess.run([sys.executable, "-m", "bench.experiments.probe_decode_replays", "--one", name, shape],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        print(f"{name}: rc={proc.returncode}: " + " | ".join(tail[-3:]), flush=True)
