#!/usr/bin/env bash
# One device call: selected GPU tests, then benchmarks of the named ops.
# Usage: bash scripts/gpu_run.sh "PYTEST_ARGS" OP [OP ...]   (PYTEST_ARGS may be "")
# Logs and results land in $OUT (default /tmp/overlap_out); the summary tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/overlap_out}; mkdir -p "$OUT"; touch "$OUT/.start"
TESTS=$1; shift
nvidia-smi -L | head -1
bash scripts/setup.sh >/dev/null 2>&1
if [ -n "$TESTS" ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu -v -p no:cacheprovider $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | tail -12
fi
for op in "$@"; do
  timeout "${BENCH_TIMEOUT:-240}" python3 -m bench --op "$op" > "$OUT/bench_$op.log" 2>&1; echo "bench $op rc=$?"
done
find bench/results -name '*.json' -newer "$OUT/.start" -exec cp {} "$OUT/" \;
for op in "$@"; do echo "=== $op"; grep -v "^W1121\|Warning\|warn" "$OUT/bench_$op.log" | tail -22; done
