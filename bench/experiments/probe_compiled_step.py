"""What each compiled TP MLP training step launches: torch's styles against ours.

``python -m bench.experiments.probe_compiled_step [--ranks 2] [--shape TxHxF]``

Compiles bench/tp_mlp.py's block (sequence-parallel up projection, SiLU, down projection)
with torch's ``ColwiseParallel`` / ``RowwiseParallel`` and with ours, runs one step (forward
and backward) on ``--ranks`` processes (GPUs where there are enough, else gloo CPU ranks),
and lists, per compiled module (forward, backward), every call in Inductor's generated
``call()``: its generated kernels (``cpp_fused_*`` on CPU, Triton kernels on CUDA), extern
GEMMs, collectives and our ops, and the buffers it allocates with their bytes. What ours
launches beyond torch's is what the compiled step must not add (issue: the compiled step
launches no more copies or kernels than torch's).

Not visible here: copies inside an op (ag_gemm's ``return_gathered`` on its fused path
clones the gathered rows out of the workspace after the GEMM: ops/ag_gemm.py).
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter

import torch

from overlap_kernels.launch import run_ranks

_KERNEL = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+)[\.(]")
_EXTERN = re.compile(r"extern_kernels\.(\w+)")
_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)")
_ALLOC = re.compile(r"empty_strided_(?:cpu|cuda)\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)")


def calls(code: str) -> Counter:
    """The calls of one generated module's ``call()``, counted by kind and name; the
    buffers it allocates as ``alloc <dtype>`` with their total bytes under ``bytes <dtype>``."""
    found: Counter = Counter()
    body = code[code.find("def call(") :]
    for line in body.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if m := _KERNEL.match(line):
            found["kernel " + re.sub(r"_\d+$", "", m.group(1))] += 1
        elif m := _EXTERN.search(line):
            found["extern " + m.group(1)] += 1
        elif (m := _OP.search(line)) and "assert_" not in line:
            found[f"op {m.group(1)}.{m.group(2)}"] += 1
        if m := _ALLOC.search(line):
            sizes = [int(d) for d in m.group(1).split(",") if d.strip()]
            found["alloc " + m.group(2)] += 1
            found["bytes " + m.group(2)] += math.prod(sizes) * getattr(torch, m.group(2)).itemsize
    return found


def _body(rank: int, world: int, use_gpu: bool, shape: tuple[int, int, int]) -> dict:
    from torch._inductor.utils import run_and_get_code

    from bench import tp_mlp
    from bench.harness import RunContext

    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if use_gpu else torch.float32
    t, h, f = shape
    mesh = tp_mlp._mesh(RunContext(rank, world, device, None, None, lambda: None, None))
    torch.manual_seed(0)
    up, down = (
        torch.randn(f, h, device=device, dtype=dtype),
        torch.randn(h, f, device=device, dtype=dtype),
    )
    found = {}
    for styles in ("torch", "ours"):
        block = tp_mlp._parallel(styles, up.clone(), down.clone(), mesh)
        fn = torch.compile(block, fullgraph=True, dynamic=False)
        x = torch.randn(t // world, h, device=device, dtype=dtype, requires_grad=True)

        def step(fn=fn, x=x):
            y = fn(x)
            (0.5 * y.float().square().sum()).backward()

        _, codes = run_and_get_code(step)
        found[styles] = [calls(code) for code in codes]
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--shape", default="64x64x128", help="TxHxF (default: a CPU-sized block)")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split("x"))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks
    found = run_ranks(_body, args.ranks, use_gpu, shape, use_gpu=use_gpu,
                      gpus=args.ranks if use_gpu else None)[0]  # fmt: skip
    for styles, modules in found.items():
        for name, counted in zip(("forward", "backward"), modules, strict=False):
            print(f"{styles} {name}:")
            for what, n in sorted(counted.items()):
                print(f"  {n:>12} {what}")


if __name__ == "__main__":
    main()
