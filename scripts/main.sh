#!/usr/bin/env bash
# The main job. No GPU: every op on 4 emulated CPU ranks, checked against fp64.
# GPUs: the benchmark suite over all GPUs of this host (runs appended to bench/results.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${PYTHON:-python3}" -m bench "$@"
