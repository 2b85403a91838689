#!/usr/bin/env bash
# One device session: versions, GPU tests, the GEMM core sweep, the benchmark.
# Usage: bash scripts/gpu_session.sh [tests] [tune] [bench] [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/overlap_out}; mkdir -p "$OUT"
want() { [[ " $* " == *" $STEP "* ]]; }
nvidia-smi -L; nvidia-smi topo -m | head -8
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'nccl', torch.cuda.nccl.version())"
bash scripts/setup.sh 2>&1 | tail -2
for STEP in tests tune bench; do
  case " $* " in *" $STEP "*) ;; *) continue ;; esac
  echo "=== $STEP ==="
  case $STEP in
    tests) timeout 170 python3 -m pytest tests/test_ag_gemm.py -m gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    tune)  timeout 200 python3 -m bench.tune_gemm 2>&1 | tee "$OUT/tune.log" ;;
    bench) extra=""; case " $* " in *" quick "*) extra="--quick" ;; esac
           timeout 300 python3 -m bench --op ag_gemm --shapes 8192x8192x7168 16384x8192x7168 4096x8192x2560 2048x8192x7168 1024x4096x4096 $extra 2>&1 | tee "$OUT/bench.log" | tail -60
           cp bench/results/*.json "$OUT/" 2>/dev/null ;;
  esac
done
