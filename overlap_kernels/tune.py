"""``python -m overlap_kernels.tune``: measure an op's candidates for given
shapes on this host and write a tuned table (tuned.py).

    python -m overlap_kernels.tune --op gemm_rs --world 4 \\
        --shapes 8192x7168x8192 2048x7168x8192 --out tables/my_host.toml

Shapes are M x K x N as the tables match them: M is the gathered M for
ag_gemm (each rank holds M / world rows), K is each rank's K slice for
gemm_rs and gemm_ar. One process per rank, on the GPUs there are (several
ranks share one where there are fewer; their times then mean nothing), or
on the CPU in Triton's interpreter where there is none. Each shape is timed
as ``overlap_kernels.autotune`` times it (ops/autotune.py), tables or not,
with the benchmark's timing (timing.py): back-to-back blocks of calls in
interleaved rounds, a barrier before each block, the median per rank and the
maximum over ranks. Its choice is written to ``--out``. Load the table with
``overlap_kernels.use_table(path)``.
"""

from __future__ import annotations

import argparse
import sys

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not MxKxN with positive sizes, e.g. 8192x7168x8192"
        )
    m, k, n = map(int, parts)
    return m, k, n


def tune_rank(
    rank: int, world: int, use_gpu: bool, op: str, shapes: list, dtype_name: str, out: str
) -> list:
    """On one rank: every shape's first call inside autotune(cache=out, retune=True)."""
    import torch
    import torch.distributed as dist

    import overlap_kernels as ok
    from overlap_kernels.ops import autotune

    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    chosen = []
    with ok.autotune(cache=out, retune=True):
        for i, (m, k, n) in enumerate(shapes):
            rows = m // world if op == "ag_gemm" else m
            x = torch.randn(rows, k, dtype=dtype, device=device)
            w = torch.randn(
                n, k, dtype=dtype, device=device
            ).t()  # nn.Linear layout, as models pass it
            getattr(ok, op)(x, w)
            ok.raise_if_failed()
            measured = autotune.last_measured.pop(op, [])
            running = getattr(ok.ops, op).running_config(x, w)
            chosen.append((f"{m}x{k}x{n}", running.path, measured))
            if rank == 0:
                print(f"[{i + 1}/{len(shapes)}] {op} {m}x{k}x{n}: {measured or 'one candidate'} -> path {running.path}",
                      flush=True)  # fmt: skip
    dist.barrier()
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m overlap_kernels.tune", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--op", choices=OPS, required=True)
    parser.add_argument(
        "--world", type=int, required=True, help="ranks of the group the table is for"
    )
    parser.add_argument("--shapes", type=parse_shape, nargs="+", required=True, metavar="MxKxN")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--out", required=True, help="tuned table to write (entries for these shapes are replaced)"
    )
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error("--world must be at least 2: one rank has nothing to overlap")
    if args.op == "ag_gemm":
        uneven = [f"{m}x{k}x{n}" for m, k, n in args.shapes if m % args.world]
        if uneven:
            parser.error(
                f"ag_gemm shapes need M divisible by --world {args.world}: {', '.join(uneven)}"
            )

    import torch

    from .launch import run_ranks

    use_gpu = torch.cuda.is_available()
    results = run_ranks(
        tune_rank, args.world, use_gpu, args.op, args.shapes, args.dtype, args.out, use_gpu=use_gpu
    )
    print(f"wrote {len(results[0])} {args.op} entries to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
