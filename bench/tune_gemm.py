"""Sweep the local GEMM core's tiles against cuBLAS on one GPU: what the template should say.

``python -m bench.tune_gemm [--decode] [MxKxN ...]`` prints, per shape, cuBLAS and each
config's median ms (``triton.testing.do_bench``, which flushes L2) and writes
``$OUT/tune_gemm.json`` (or ./tune_gemm.json). Weight in nn.Linear layout.
"""

from __future__ import annotations

import json
import os
import sys

import torch

SHAPES = [(8192, 8192, 7168), (16384, 8192, 7168), (4096, 8192, 2560), (2048, 8192, 7168), (2048, 2048, 7168)]
# (block_m, block_n, block_k, num_warps, num_stages, group_m)
CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 4, 4, 8),
    (128, 128, 128, 8, 3, 8),
    (64, 256, 64, 4, 4, 8),
    (256, 128, 64, 8, 3, 8),
]
# Decode (gemm_ar at M <= 256): the weight read is the cost, so what matters is
# how many SMs stream it at once (N / block_n tiles per M-block) and how many
# bytes each keeps in flight (block_k x stages).
DECODE_SHAPES = [(16, 7168, 8192), (64, 7168, 8192), (256, 7168, 8192)]
DECODE_CONFIGS = [
    (64, 64, 128, 4, 4, 1),
    (64, 64, 128, 4, 6, 1),
    (64, 32, 128, 4, 6, 1),
    (64, 128, 64, 4, 4, 1),
    (16, 64, 128, 4, 6, 1),
    (128, 64, 64, 4, 4, 1),
    (128, 128, 64, 8, 4, 1),
]


def main(argv: list[str]) -> None:
    import triton

    import overlap_kernels as ok

    decode = "--decode" in argv
    argv = [a for a in argv if a != "--decode"]
    shapes = [tuple(int(v) for v in s.split("x")) for s in argv] or (DECODE_SHAPES if decode else SHAPES)
    configs = DECODE_CONFIGS if decode else CONFIGS
    results = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ weight.float().t()
        row = {"shape": [m, k, n], "cublas_ms": triton.testing.do_bench(lambda: a @ weight.t(), return_mode="median")}
        for bm, bn, bk, warps, stages, gm in configs:
            cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=gm)
            name = f"{bm}x{bn}x{bk}w{warps}s{stages}"
            try:
                out = ok.matmul(a, weight.t(), cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(lambda: ok.matmul(a, weight.t(), cfg), return_mode="median")
                row[name] = {"ms": ms, "err": err}
            except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        results.append(row)
        flops = 2 * m * n * k
        cells = [f"cublas {row['cublas_ms']:.3f} ({flops / row['cublas_ms'] / 1e9:.0f} TF)"]
        for key, v in row.items():
            if isinstance(v, dict) and "ms" in v:
                cells.append(f"{key} {v['ms']:.3f} ({100 * row['cublas_ms'] / v['ms']:.0f}%, err {v['err']:.1e})")
            elif isinstance(v, dict):
                cells.append(f"{key} FAILED {v['error'][:80]}")
        print(f"{m}x{k}x{n}: " + " | ".join(cells), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "tune_gemm_decode.json" if decode else "tune_gemm.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
